"""Engines: where chunks are transformed, compressed, checksummed and decoded.

The save and restore drivers (``save.py``, ``load.py``) are written against the ``Engine``
interface below; ``HostEngine`` runs it on a CPU thread pool, and the GPU engine
(``gpu_engine.py``) runs the same interface with nvCOMP batches on a CUDA stream. An engine
returns ``EncodedChunk`` payloads in a buffer kind the storage writer it is paired with accepts
(host arrays for POSIX, device arrays for kvikio).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..codecs import BYTE_PLANES, Chain, Codec, host_codec, transform
from ..codecs.cpu import DeflateCodec, ZstdCodec
from ..errors import CorruptCheckpointError
from ..format import align_up, checksum
from ..format.index import ChunkRecord
from ..io.base import aligned_empty
from .plan import ArraySource, ChunkPlan

NONE_CHAIN = Chain.of({"name": "none/1"})
TRIAL_BYTES = 128 * 1024
"""Bytes of an array compressed both ways to decide whether byte planes help it."""


@dataclass
class EncodedChunk:
    """A compressed chunk ready to write: ``payload`` is zero-padded to a multiple of 4096."""

    payload: Any
    stored: int
    raw: int
    crc: int
    chain: Chain
    release: Callable[[], None] | None = None
    """Called by the save driver once the payload's write has completed (returns staging memory)."""


class Engine(ABC):
    """Encodes planned chunks and decodes stored ones. Call ``close()`` when done."""

    name: str
    max_pending: int | None = None
    """Most chunks that may be between ``submit_encode`` and the release of their payload
    (None: no limit beyond the driver's byte budget). The GPU engine's staging slots set it."""

    def read_buffer(self, nbytes: int) -> Any:
        """A buffer for one chunk read, of the kind ``submit_decode`` takes (host by default)."""
        return aligned_empty(nbytes)

    @abstractmethod
    def submit_encode(self, chunk: ChunkPlan) -> Future[EncodedChunk]:
        """Start encoding ``chunk``; futures complete in any order."""

    @abstractmethod
    def submit_decode(self, record: ChunkRecord, chain: list[dict[str, Any]], stored: Any,
                      deliver: Callable[[Any], None]) -> Future[None]:
        """Check ``stored`` (the padded bytes read for ``record``) against the record's checksum,
        decode it through ``chain`` and pass the raw bytes to ``deliver``.

        Raises ``CorruptCheckpointError`` (through the future) on a checksum mismatch or an
        undecodable stream.
        """

    @abstractmethod
    def close(self) -> None:
        """Release threads and buffers."""


def make_host_codec(name: str, level: int | None) -> Codec:
    """A host codec by user-facing name, with the configured compression level where it has one."""
    if name == "zstd" and level is not None:
        return ZstdCodec(level)
    if name == "deflate" and level is not None:
        return DeflateCodec(min(9, max(0, level)))
    return host_codec(name)


class HostEngine(Engine):
    """Runs chains on a CPU thread pool (zstd, LZ4 and zlib release the GIL while they work)."""

    name = "cpu"

    def __init__(self, sources: list[ArraySource], *, codec: str, byte_planes: str, threads: int,
                 level: int | None = None):
        self.sources = sources
        self.codec = make_host_codec(codec, level)
        self.byte_planes = byte_planes
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="gdsckpt-codec")
        self._decisions: dict[int, Future[bool]] = {}
        self._decisions_lock = threading.Lock()
        self._codecs: dict[str, Codec] = {}

    # -- save ------------------------------------------------------------------------------
    def submit_encode(self, chunk: ChunkPlan) -> Future[EncodedChunk]:
        decision, owner = self._decision_for(chunk)
        return self._pool.submit(self._encode, chunk, decision, owner)

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
        raw = self._gather(chunk)
        params = {"width": chunk.plane_width}
        if owner and not decision.done():
            try:
                sample = raw[: min(raw.nbytes, TRIAL_BYTES) // chunk.plane_width * chunk.plane_width]
                plain = len(self.codec.encode(sample))
                planed = len(self.codec.encode(BYTE_PLANES.forward(sample, params)))
                decision.set_result(planed < plain)
            except BaseException as err:
                decision.set_exception(err)
                raise
        # The owner of a group is submitted before the group's other chunks and the pool is FIFO,
        # so this wait never blocks on a task that has not started.
        use_planes = decision.result()
        data = BYTE_PLANES.forward(raw, params) if use_planes else raw
        encoded = self.codec.encode(data)
        stored_view = memoryview(encoded).cast("B")
        if len(stored_view) >= raw.nbytes and self.codec.name != "none/1":
            stored_view, chain = memoryview(raw).cast("B"), NONE_CHAIN
        else:
            stages = ([{"name": BYTE_PLANES.name, "width": chunk.plane_width}] if use_planes else [])
            chain = Chain.of(*stages, self.codec.stage())
        stored = len(stored_view)
        payload = aligned_empty(align_up(stored))
        payload[:stored] = np.frombuffer(stored_view, dtype=np.uint8)
        payload[stored:] = 0
        return EncodedChunk(payload, stored, raw.nbytes, checksum(payload[:stored]), chain)

    # -- restore ---------------------------------------------------------------------------
    def submit_decode(self, record: ChunkRecord, chain: list[dict[str, Any]], stored: Any,
                      deliver: Callable[[Any], None]) -> Future[None]:
        return self._pool.submit(self._decode, record, chain, stored, deliver)

    def _codec(self, name: str) -> Codec:
        codec = self._codecs.get(name)
        if codec is None:
            codec = self._codecs[name] = host_codec(name)
        return codec

    def _decode(self, record: ChunkRecord, chain: list[dict[str, Any]], stored: Any,
                deliver: Callable[[Any], None]) -> None:
        deliver(decode_host_chunk(record, chain, stored, self._codec))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def decode_host_chunk(record: ChunkRecord, chain: list[dict[str, Any]], stored: np.ndarray,
                      codec_for: Callable[[str], Codec]) -> np.ndarray:
    """Verify and decode one chunk on the host; returns its raw bytes as a uint8 array."""
    body = stored[: record.stored]
    if checksum(body) != record.crc:
        raise CorruptCheckpointError("chunk checksum mismatch")
    codec = codec_for(chain[-1]["name"])  # unknown or GPU-only codecs raise their own errors
    try:
        data = np.frombuffer(codec.decode(body, record.raw), dtype=np.uint8)
        for stage in reversed(chain[:-1]):
            data = transform(stage["name"]).inverse(data, stage)
    except (ValueError, RuntimeError, MemoryError) as err:
        raise CorruptCheckpointError(f"chunk does not decode ({err})") from err
    except Exception as err:  # each library raises its own error type for a corrupt stream
        if type(err).__module__.split(".")[0] in ("zstandard", "lz4", "zlib"):
            raise CorruptCheckpointError(f"chunk does not decode ({err})") from err
        raise
    if data.nbytes != record.raw:
        raise CorruptCheckpointError(f"chunk decoded to {data.nbytes} bytes, expected {record.raw}")
    return data
