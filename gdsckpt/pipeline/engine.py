"""Engines: where chunks are transformed, compressed, checksummed and decoded.

The save driver (``save.py``) is written against the ``Encoder`` interface below and the restore
driver (``load.py``) against ``Decoder``. ``HostEngine`` is both, on a CPU thread pool; on the GPU
the two directions are separate classes over one staging-ring type (``gdsckpt.pipeline.gpu``:
``GpuEncoder``, ``GpuDecoder``) running nvCOMP batches on a CUDA stream. An encoder returns
``EncodedChunk`` payloads in a buffer kind the storage writer it is paired with accepts (host
arrays for POSIX, device arrays for kvikio).

Adaptive compression (``HostEngine(adaptive=True)``, what ``codec="auto"`` runs on the CPU): each
chunk looks at the writer when its codec thread takes it up: the writer's ``pace`` (pending bytes,
measured write speed) against the engine's measured codec speed and ratio decides. Stored as it
is (``none/1``), the chunk is on storage after the pending writes (``drain``) plus its own write
(``write``); compressed, after ``max(drain, encode) + write / ratio``. So it is compressed exactly
when ``encode < drain + write * (1 - 1 / ratio)``: whenever the storage stays busy meanwhile, and
beyond that while the bytes saved pay for the wait, a storage waiting for the codec threads
(nothing pending) included: zeros compress faster than a disk writes them, and were stored whole
when an idle writer alone meant "as it is". A writer whose writes cost nothing (the null sink)
gets every chunk as it is. (Chunks are placed in
plan order, so a chunk still compressing holds back the writes of the chunks after it: waiting
for it is real idle storage.) The share of compressed chunks so settles where the codec threads
and the storage keep pace: all of them on a slow disk, few or none on tmpfs or a null sink.
Before anything is measured, chunks are compressed. Which chunks were stored as they are depends
on timing; every chunk is lossless and checksummed either way. A delta's chunks (XOR with a base)
are always compressed.
"""

from __future__ import annotations

import math
import re
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lz4.block
import numpy as np
import zstandard

from ..codecs import (
    BYTE_PLANES,
    HOST_ZSTD_LEVEL,  # noqa: F401 - re-exported for gdsckpt.state.lossy (moves to ..codecs)
    Chain,
    Codec,
    host_codec,
    host_encoder,
    host_planes_encoder,
    transform,
)
from ..errors import CorruptCheckpointError
from ..format import align_up, checksum
from ..format.index import ChunkRecord
from ..io.base import WritePace, aligned_empty
from ..io.pools import DRAIN_TIMEOUT, Lane
from .plan import ArraySource, ChunkPlan

if TYPE_CHECKING:
    from .gpu.staging import ReadArena

NONE_CHAIN = Chain.of({"name": "none/1"})
PACE_WEIGHT = 0.25
"""Weight of the newest compressed chunk in the codec's measured speed and ratio."""
TRIAL_BYTES = 128 * 1024
"""Bytes of an array compressed both ways to decide whether byte planes help it."""
RESAMPLE_EVERY = 8
"""After this many chunks in a row stored as they are, the next one's first ``TRIAL_BYTES`` are
compressed to measure the codec again (``HostEngine(adaptive=True)``): only compressed chunks
measure it, so a save whose first arrays did not compress stored every later one whole (zeros
after random bytes) however well it would have compressed. A sample, not the chunk: compressing
every eighth chunk whole would hold back the storage the decision kept waiting for nothing."""


@dataclass
class EncodedChunk:
    """An encoded chunk ready to write: ``payload`` is zero-padded to a multiple of
    ``format.ALIGNMENT``, or is exactly ``stored`` bytes (a chunk of codec ``none`` written from
    the state's own memory); the driver places the next chunk at the next aligned offset either
    way, and every writer fills a gap with zeros (a file's hole reads as zeros)."""

    payload: Any
    stored: int
    raw: int
    crc: int
    chain: Chain
    release: Callable[[], None] | None = None
    """Called by the save driver once the payload's write has completed (returns staging memory)."""
    live: bool = False
    """``payload`` is the state's own memory, written from there after ``crc`` was taken: the
    driver checks, once it is written, that the memory still holds what ``crc`` covers."""


class Encoder(ABC):
    """Encodes planned chunks for the save driver. Call order: ``submit_encode`` per chunk (never
    more than ``max_pending`` payloads unreleased), ``EncodedChunk.release`` once each payload is
    written, then ``close()``."""

    name: str
    max_pending: int | None = None
    """Most chunks that may be between ``submit_encode`` and the release of their payload
    (None: no limit beyond the driver's byte budget). The GPU encoder's staging slots set it."""
    stalled: bool = False
    """Set by a driver whose wait for one of this engine's chunks outlasted its timeout: ``close``
    then does not wait another timeout for the stuck work (which keeps what it holds), so the
    operation fails after one timeout with the driver's error, which names the chunk."""

    @abstractmethod
    def submit_encode(self, chunk: ChunkPlan) -> Future[EncodedChunk]:
        """Start encoding ``chunk``; futures complete in any order."""

    def watch_storage(self, backlog: Callable[[], int | None],
                      pace: Callable[[], WritePace | None] | None = None) -> None:
        """Called by the save driver before the first chunk with the writer's ``backlog`` and
        ``pace``: an engine that adapts its compression to the storage reads them (``HostEngine``
        with ``adaptive``); the others ignore them."""
        return  # an optional hook: engines that do not adapt need not override it

    @abstractmethod
    def close(self) -> None:
        """Release threads and buffers."""


class Decoder(ABC):
    """Verifies and decodes stored chunks for the restore driver. Call order: ``reserve_reads``
    once with the chunks about to be read, then per chunk ``read_buffer`` (the storage reader
    fills it) and ``submit_decode``, keeping no more chunks outstanding than ``reserve_reads``
    returned; then ``close()``."""

    name: str
    stalled: bool = False
    """As ``Encoder.stalled``, for a restore driver's wait on a decode."""
    device_places: int | None = None
    """The CUDA device whose memory this decoder writes itself when ``submit_decode`` names
    ``places`` there; None for a decoder that only hands bytes to ``deliver``."""

    def reserve_reads(self, records: list[ChunkRecord], codecs: Any = ()) -> int | None:
        """Prepare to restore ``records`` (the chunks about to be read, in order; ``codecs``: the
        bitstream names their chains end in); return the most
        chunks that may be outstanding at once (read buffer handed out, decode not finished), or
        None for no limit beyond the driver's byte budget. The GPU decoder allocates its read ring
        here and returns its slot count."""
        return None

    def read_arena(self) -> ReadArena | None:
        """Memory for grouped reads (several consecutive chunks read by one storage call, each
        chunk then decoded from its view there: ``read_buffer``'s ``within``), or None: one read
        per chunk (the default). Valid after ``reserve_reads``."""
        return None

    def read_buffer(self, nbytes: int, within: Any = None) -> Any:
        """A buffer for one chunk read, of the kind ``submit_decode`` takes (host by default).
        ``within``: the chunk's bytes in ``read_arena``, filled by a grouped read: returned, with
        whatever else the decoder reserves per chunk."""
        return aligned_empty(nbytes) if within is None else within

    def release_staging(self) -> None:
        """Give back what ``reserve_reads`` allocated, once its restore is over (a decoder kept
        for further restores reserves again for the next). Nothing to give back by default."""
        return None

    @abstractmethod
    def submit_decode(self, record: ChunkRecord, chain: list[dict[str, Any]], stored: Any,
                      deliver: Callable[[Any], None], *, to_host: bool = False,
                      places: list[tuple[int, int, int]] | None = None,
                      into: np.ndarray | None = None) -> Future[None]:
        """Check ``stored`` (the padded bytes read for ``record``) against the record's checksum,
        decode it through ``chain`` and pass the raw bytes to ``deliver``. ``to_host``: every
        destination of the chunk is host memory (a device decoder then hands ``deliver`` host
        bytes; the host engine always does). ``places``: only for a decoder with
        ``device_places``, every destination of the chunk as ``(raw offset, length, address)`` on
        that device: the decoder may write the raw bytes there itself instead of calling
        ``deliver`` (either reaches the same bytes). ``into``: host memory that takes the whole
        raw chunk (its one destination): the decoder may decode into it instead of calling
        ``deliver`` (either reaches the same bytes; the host engine does).

        Raises ``CorruptCheckpointError`` (through the future) on a checksum mismatch or an
        undecodable stream.
        """

    @abstractmethod
    def close(self) -> None:
        """Release threads and buffers."""


class Engine(Encoder, Decoder):
    """Both directions in one object (the CPU engine). Call ``close()`` when done."""


class HostEngine(Engine):
    """Runs chains on the process's shared codec threads, at most ``threads`` chunks at once
    (zstd, LZ4 and zlib release the GIL while they work). ``timeout``: seconds any wait of the
    engine's own may take (a chunk's wait for its group's byte-planes decision, ``close``)."""

    name = "cpu"

    def __init__(self, sources: list[ArraySource], *, codec: str, byte_planes: str, threads: int,
                 level: int | None = None, timeout: float = DRAIN_TIMEOUT, adaptive: bool = False,
                 as_is_views: bool = False):
        self.sources = sources
        self.as_is_views = as_is_views
        """With codec ``none`` (stored as it is by choice: the codec, or ``auto``'s whole-save
        decision), hand the writer the state's own memory instead of a copy in an aligned buffer.
        The copy buys O_DIRECT; without it the POSIX writer writes buffered and starts the
        write-back at once, which measured faster on a virtual disk (``io.posix``) and skips a
        memcpy into fresh pages. The save API turns it off only for ``Config.o_direct=True``."""
        self.adaptive = adaptive and codec != "none"
        """``codec="auto"``: a chunk is stored uncompressed where the writer's measured pace says
        it reaches storage sooner that way, so compression never holds back storage faster than
        the codec threads (module docstring)."""
        self.stored_raw = 0
        """Chunks ``adaptive`` stored uncompressed because that was the faster way."""
        self._backlog: Callable[[], int | None] | None = None
        self._pace: Callable[[], WritePace | None] | None = None
        self._encode_seconds_per_byte: float | None = None
        """Seconds one codec thread took per raw byte of a compressed chunk (moving average)."""
        self._ratio = 1.0
        """Raw over stored bytes of the compressed chunks (moving average)."""
        self._as_is_run = 0
        """Chunks stored as they are since the codec was last measured (``RESAMPLE_EVERY``)."""
        self.codec = host_encoder(codec, level)
        # byte-planed chunks at the default zstd level get the compressor tuned for them
        self._planes_codec = host_planes_encoder(codec, level)
        self.byte_planes = byte_planes
        self.timeout = timeout
        self._lane = Lane("codec", threads)
        self._decisions: dict[int, Future[bool]] = {}
        self._decisions_lock = threading.Lock()
        self._codecs: dict[str, Codec] = {}

    # -- save ------------------------------------------------------------------------------
    def submit_encode(self, chunk: ChunkPlan) -> Future[EncodedChunk]:
        """Compress ``chunk`` on a codec thread (or store it as it is where the adaptive rule says
        so); a future of its ``EncodedChunk``."""
        decision, owner = self._decision_for(chunk)
        return self._lane.submit(self._encode, chunk, decision, owner)

    def watch_storage(self, backlog: Callable[[], int | None],
                      pace: Callable[[], WritePace | None] | None = None) -> None:
        """Give the adaptive rule the writer's queued bytes (``backlog``) and write pace (``pace``)
        to weigh (module docstring)."""
        self._backlog = backlog
        self._pace = pace

    def _store_as_is(self, raw_bytes: int) -> bool:
        """Whether a chunk of ``raw_bytes`` starting now is better stored as it is (``adaptive``
        only; module docstring): yes when the writer's writes cost nothing, or when its measured
        pace says the chunk stored as it is would be on storage before its compressed form:
        compressing takes ``encode`` seconds (this engine's measured speed), while the pending
        writes take ``drain`` and the chunk's own write shrinks by ``saved``."""
        if not self.adaptive or self._backlog is None or self._backlog() is None:
            return False
        pace = self._pace() if self._pace is not None else None
        if pace is not None and pace.bytes_per_second == math.inf:
            return True  # storage that costs nothing: compressing saves no time
        with self._decisions_lock:
            seconds_per_byte, ratio = self._encode_seconds_per_byte, self._ratio
        if pace is None or not pace.bytes_per_second or seconds_per_byte is None:
            return False  # nothing measured yet: compress, which measures the codec
        drain = pace.pending_bytes / pace.bytes_per_second
        saved = raw_bytes / pace.bytes_per_second * (1 - 1 / max(ratio, 1.0))
        return raw_bytes * seconds_per_byte > drain + saved

    def _resample_due(self) -> bool:
        """Count one more chunk stored as it is; True every ``RESAMPLE_EVERY``-th in a row."""
        with self._decisions_lock:
            self._as_is_run += 1
            if self._as_is_run < RESAMPLE_EVERY:
                return False
            self._as_is_run = 0
            return True

    def _sample_codec(self, raw: np.ndarray, width: int, use_planes: bool) -> None:
        """Measure the codec on the first ``TRIAL_BYTES`` of ``raw`` as the chunk would be encoded
        (its byte planes each on their own, as the planes decision samples them)."""
        width = max(width, 1)  # 0: an array not split into planes
        sample = raw[: min(raw.nbytes, TRIAL_BYTES) // width * width]
        if not sample.nbytes:
            return
        started = time.perf_counter()
        stored = self._planes_size(sample, width) if use_planes else len(self.codec.encode(sample))
        self._measured(sample.nbytes, stored, time.perf_counter() - started)

    def _planes_size(self, sample: np.ndarray, width: int) -> int:
        """Bytes ``sample`` compresses to as byte planes, each plane on its own (the measure both
        the planes decision and the codec's re-measure take)."""
        planes = BYTE_PLANES.forward(sample, {"width": width})
        size = planes.size // width
        return sum(len(self._planes_codec.encode(planes[k * size:(k + 1) * size])) for k in range(width))

    def codec_pace(self) -> tuple[float, float] | None:
        """(raw bytes per second of one codec thread, ratio) measured on the chunks this engine
        compressed adaptively; None before the first."""
        with self._decisions_lock:
            if self._encode_seconds_per_byte is None or self._encode_seconds_per_byte <= 0:
                return None
            return 1.0 / self._encode_seconds_per_byte, self._ratio

    def _measured(self, raw_bytes: int, stored_bytes: int, seconds: float) -> None:
        """Fold one compressed chunk into the codec's speed and ratio (moving averages)."""
        if raw_bytes <= 0 or stored_bytes <= 0:
            return
        with self._decisions_lock:
            speed, ratio = seconds / raw_bytes, raw_bytes / stored_bytes
            if self._encode_seconds_per_byte is None:
                self._encode_seconds_per_byte, self._ratio = speed, ratio
            else:
                self._encode_seconds_per_byte += PACE_WEIGHT * (speed - self._encode_seconds_per_byte)
                self._ratio += PACE_WEIGHT * (ratio - self._ratio)

    def _decision_for(self, chunk: ChunkPlan) -> tuple[Future[bool], bool]:
        """The shared future deciding byte planes for the chunk's group; True if this chunk owns it."""
        with self._decisions_lock:
            existing = self._decisions.get(chunk.decision_group)
            if existing is not None:
                return existing, False
            decision: Future[bool] = Future()
            if chunk.plane_width == 0 or self.byte_planes == "never" or self.codec.name == "none/1":
                decision.set_result(False)
            elif self.byte_planes == "always":
                decision.set_result(True)
            self._decisions[chunk.decision_group] = decision
            return decision, True

    def _gather(self, chunk: ChunkPlan) -> np.ndarray:
        pieces = [self.sources[p.array].host_bytes(p.start, p.stop) for p in chunk.parts]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _encode(self, chunk: ChunkPlan, decision: Future[bool], owner: bool) -> EncodedChunk:
        try:
            raw = self._gather(chunk)
        except BaseException as err:
            # The group's other chunks wait for its owner's decision: an owner whose bytes cannot
            # be read (a delta's damaged base chunk) must fail them too, not leave them waiting
            # out the timeout while their own reads succeeded.
            if owner and not decision.done():
                decision.set_exception(err)
            raise
        params = {"width": chunk.plane_width}
        if owner and not decision.done():
            try:
                sample = raw[: min(raw.nbytes, TRIAL_BYTES) // chunk.plane_width * chunk.plane_width]
                plain = len(self.codec.encode(sample))
                # Each plane of the sample on its own: in a full chunk every plane spans whole
                # zstd blocks with their own Huffman tables, which one small block of mixed planes
                # does not show (measured on fp32 weights: per plane predicts a 4 MiB chunk's 1.20
                # within 0.1%; the 128 KiB of planes as one frame said 1.11 at level 1 and 1.08,
                # no better than plain zstd, with the planes compressor's small match table).
                decision.set_result(self._planes_size(sample, chunk.plane_width) < plain)
            except BaseException as err:
                decision.set_exception(err)
                raise
        # The owner of a group is submitted before the group's other chunks and the lane starts
        # tasks in order, so this wait never blocks on a task that has not started.
        use_planes = decision.result(timeout=self.timeout)
        # Compressing would only delay a waiting writer; a delta's chunks are compressed anyway
        # (storing little is what a delta is for, and the XOR of close weights compresses fast).
        as_is = not chunk.delta and self._store_as_is(raw.nbytes)
        if as_is and self._resample_due():
            self._sample_codec(raw, chunk.plane_width, use_planes)
            as_is = self._store_as_is(raw.nbytes)
        started = time.perf_counter()
        if as_is:
            with self._decisions_lock:
                self.stored_raw += 1
            encoded: Any = raw
        elif use_planes:
            encoded = self._planes_codec.encode(BYTE_PLANES.forward(raw, params))
        else:
            encoded = self.codec.encode(raw)
        if not as_is and self.adaptive:
            self._measured(raw.nbytes, len(memoryview(encoded).cast("B")), time.perf_counter() - started)
            with self._decisions_lock:
                self._as_is_run = 0
        stored_view = memoryview(encoded).cast("B")
        if as_is or (len(stored_view) >= raw.nbytes and self.codec.name != "none/1"):
            stored_view, chain = raw.data.cast("B"), NONE_CHAIN
        else:
            stages = ([{"name": BYTE_PLANES.name, "width": chunk.plane_width}] if use_planes else [])
            chain = Chain.of(*stages, self.codec.stage())
        stored = len(stored_view)
        if self.as_is_views and self.codec.name == "none/1" and raw.flags.c_contiguous:
            payload = raw.reshape(-1).view(np.uint8)
            return EncodedChunk(payload, stored, raw.nbytes, checksum(payload), chain, live=True)
        payload = aligned_empty(align_up(stored))
        payload[:stored] = np.frombuffer(stored_view, dtype=np.uint8)
        payload[stored:] = 0
        return EncodedChunk(payload, stored, raw.nbytes, checksum(payload[:stored]), chain)

    # -- restore ---------------------------------------------------------------------------
    def submit_decode(self, record: ChunkRecord, chain: list[dict[str, Any]], stored: Any,
                      deliver: Callable[[Any], None], *, to_host: bool = False,
                      places: list[tuple[int, int, int]] | None = None,
                      into: np.ndarray | None = None) -> Future[None]:
        """Undo ``chain`` on ``stored`` on a codec thread (into ``into`` where given) and pass the
        bytes to ``deliver``. ``to_host`` and ``places`` are the GPU engine's: this engine's
        output is in host memory already."""
        return self._lane.submit(self._decode, record, chain, stored, deliver, into)

    def _codec(self, name: str) -> Codec:
        codec = self._codecs.get(name)
        if codec is None:
            codec = self._codecs[name] = host_codec(name)
        return codec

    def _decode(self, record: ChunkRecord, chain: list[dict[str, Any]], stored: Any,
                deliver: Callable[[Any], None], into: np.ndarray | None) -> None:
        if into is not None:  # the chunk's one destination: its last stage writes there
            decode_host_chunk(record, chain, stored, self._codec, out=into)
        else:
            deliver(decode_host_chunk(record, chain, stored, self._codec))

    def close(self) -> None:
        """Cancel the chunks not started and wait (up to ``timeout``) for running ones;
        ``TimeoutError`` where one still runs, unless the operation has already failed on it."""
        # Chunks not started are cancelled; running ones read sources and write targets the
        # caller owns again once this returns, so they are waited for (bounded; not again where
        # the driver's own wait already timed out: ``stalled``).
        if not self._lane.close(0.0 if self.stalled else self.timeout) and not self.stalled:
            raise TimeoutError(f"codec tasks still running {self.timeout} s after the engine was closed")


CORRUPT_STREAM_ERRORS: tuple[type[Exception], ...] = (
    zstandard.ZstdError,
    lz4.block.LZ4BlockError,
    zlib.error,
)
"""What the codec libraries raise for a stream they cannot decode (python-zstandard also for an
allocation failure inside zstd, which ``_is_allocation_failure`` tells apart)."""
_ALLOCATION_FAILURE = re.compile(r"memory allocation|not enough memory|insufficient memory|^Error -4 ")
"""How an allocation failure reads in those errors: zstd's ``memory_allocation`` error ("Allocation
error : not enough memory"), zlib's ``Z_MEM_ERROR`` (-4, "insufficient memory")."""


def _is_allocation_failure(err: BaseException) -> bool:
    """Whether a codec library's error reports that memory ran out rather than a corrupt stream."""
    return bool(_ALLOCATION_FAILURE.search(str(err)))


def decode_host_chunk(record: ChunkRecord, chain: list[dict[str, Any]], stored: np.ndarray,
                      codec_for: Callable[[str], Codec], out: np.ndarray | None = None) -> np.ndarray:
    """Verify and decode one chunk on the host; returns its raw bytes as a uint8 array: ``out``
    where given (a contiguous uint8 array of the chunk's raw length, written by the chain's last
    stage, or by a copy where the chain has no transform), else a new array. ``out`` is written
    only once every check before the last stage has passed: a chunk that fails its checksum or
    its codec leaves it as it was.

    Raises ``CorruptCheckpointError`` only on proof of damage: a checksum mismatch, a stream the
    codec library rejects as corrupt, a size or stage parameter that does not fit the chunk.
    Running out of memory (``MemoryError``), interruption and every other error propagate as
    themselves, so that ``CheckpointManager.restore_latest`` stops instead of passing over an
    intact checkpoint.
    """
    body = stored[: record.stored]
    if checksum(body) != record.crc:
        raise CorruptCheckpointError("chunk checksum mismatch")
    codec = codec_for(chain[-1]["name"])  # unknown or GPU-only codecs raise their own errors
    try:
        data = np.frombuffer(codec.decode(body, record.raw), dtype=np.uint8)
        stages = chain[-2::-1]  # the transforms, last applied first
        for position, stage in enumerate(stages):
            if out is not None and position == len(stages) - 1:
                data = transform(stage["name"]).inverse_into(data, stage, out)
            else:
                data = transform(stage["name"]).inverse(data, stage)
    except ValueError as err:
        # The codecs and transforms raise ValueError for a stream or a stage parameter that does
        # not fit the chunk (a wrong size, a width that does not divide it): proof of damage.
        raise CorruptCheckpointError(f"chunk does not decode ({err})") from err
    except CORRUPT_STREAM_ERRORS as err:
        if _is_allocation_failure(err):
            raise MemoryError(f"out of memory decoding a chunk ({err})") from err
        raise CorruptCheckpointError(f"chunk does not decode ({err})") from err
    # Anything else (MemoryError, KeyboardInterrupt, OSError, RuntimeError, ...) is not proof that
    # the file is damaged and propagates as itself: a restore must stop, not skip a good file.
    if data.nbytes != record.raw:
        raise CorruptCheckpointError(f"chunk decoded to {data.nbytes} bytes, expected {record.raw}")
    if out is not None and data is not out:  # a chain without a transform
        np.copyto(out, data)
        return out
    return data
