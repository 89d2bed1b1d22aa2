"""The GPU encoder: the save direction of the GPU pipeline, nvCOMP batches on one stream.

A worker thread (``BatchWorker``: device made current first) takes whatever chunks are queued,
up to ``batch_chunks``, gathers each into a slot of a ``StagingRing`` that is allocated once per
encoder (``max_staging_bytes``, never per chunk), applies byte planes on the device where they
help, compresses the batch with one nvCOMP call per codec variant into the slots' output areas,
zero pads the streams to ``format.ALIGNMENT``, computes their CRC-32C on the device and hands the
slots to the writer (kvikio) as payloads. A slot returns to the ring when the save driver reports
its write done (``EncodedChunk.release``); the driver never has more chunks outstanding than there
are slots (``max_pending``), so the worker never waits for a slot that cannot come back.

Host sources: an array in host memory (a pinned snapshot of CUDA tensors taken by
``save_async``) is copied into its staging slot on the encoder's stream (asynchronous when the
memory is pinned) and compressed there like device data.

Lossy arrays (``RoundedArraySource``): where ``save(lossy=...)`` rounded a float32 / float16 array
to its grid and the save runs a GPU-only codec, its chunks go to nvCOMP Bitcomp's lossy mode
(``nvcomp.bitcomp-lossy/1`` with ``delta`` = the grid's step), each stream decoded again at once
and compared with the rounded values (``codecs.device.same_values``): device chunks of one step in
one nvCOMP call into their slots' free input areas (each nvCOMP call costs milliseconds through
Python, so one call per chunk made the lossy save a third slower), chunks gathered from host
memory one by one into a verification buffer. A chunk that fails, or does not shrink, takes the
codec's path like any other. The check is what makes the lossy record's ``max_error`` hold for
what a reader gets, whatever Bitcomp's quantizer does at the edges (integer overflow, outliers).

All device work goes through a ``codecs.device.DeviceBackend`` (``CudaDevice`` unless a test
passes its NumPy stand-in).
"""

from __future__ import annotations

import contextlib
import logging
import math
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, Protocol, runtime_checkable

from ...codecs import BYTE_PLANES, PORTABLE_CODECS, Chain, gpu_codec_names
from ...codecs.device import (
    DeviceBackend,
    DeviceCodecLike,
    ans_data_type,
    backend_or_cuda,
    planes_forward_into,
    same_values,
)
from ...codecs.nvcomp import BITCOMP_LOSSY_TYPES
from ...format import align_up
from ..engine import NONE_CHAIN, EncodedChunk, Encoder
from ..plan import ArraySource, ChunkPlan
from .staging import STAGING_RING_SHARE, StagingRing, encode_scratch, slots_that_fit
from .worker import BATCH_CHUNKS, BatchWorker, WorkerOwner

_log = logging.getLogger(__name__)
TRIAL_BYTES = 1 << 20
"""Bytes of a chunk compressed both ways when a trial decides byte planes."""
MIN_FITTED_CHUNK_BYTES = 64 << 10
"""The smallest size ``GpuEncoder._fit`` halves chunks to so that a save's staging fits
``max_staging_bytes``: below it the per-chunk costs (nvCOMP's per-chunk work, index records)
would dominate; a budget that cannot hold two slots of it is refused instead."""


class Rounding(Protocol):
    """What the encoder reads of how ``save(lossy=...)`` rounded an array
    (``gdsckpt.state.lossy.Rounding``)."""

    mode: str
    """``"grid"`` (values on multiples of ``step``) or ``"mantissa"`` (low bits cleared)."""
    step: float
    """The grid's step (mode ``grid``)."""
    bitcomp: bool
    """Whether the values may be stored as Bitcomp lossy streams."""


GATHER_KERNEL_BYTES = 256 << 10
"""Device ranges up to this size that a packed chunk gathers are copied by one kernel per chunk
(``DeviceBackend.gather``) instead of one array object and copy each: a chunk packs up to
thousands of small tensors, and the per-range Python cost is what a state of many small tensors
pays (larger ranges keep the copy, which moves them at full bandwidth)."""


@runtime_checkable
class RoundedArraySource(Protocol):
    """An ``ArraySource`` whose values ``save(lossy=...)`` rounded
    (``gdsckpt.state.lossy.RoundedSource``): it has the two attributes below, other sources have
    neither. The encoder tells them apart with ``isinstance`` on this protocol."""

    rounding: Rounding
    dtype: str
    """The array's dtype name (``"float32"``)."""


def bitcomp_data_type(source: ArraySource) -> str | None:
    """nvCOMP data type under which Bitcomp's lossy mode may code ``source``: arrays rounded
    to a grid by ``save(lossy=...)`` (policy ``bitcomp`` on), float32 or float16."""
    if not isinstance(source, RoundedArraySource):
        return None
    rounding = source.rounding
    if rounding.mode != "grid" or not rounding.bitcomp:
        return None
    return BITCOMP_LOSSY_TYPES.get(source.dtype)


@dataclass
class EncodeJob:
    """One chunk queued for the worker."""

    chunk: ChunkPlan
    future: Future[EncodedChunk]


class _Encoded(NamedTuple):
    """A chunk compressed into its slot, before padding and CRC."""

    job: EncodeJob
    padded: Any
    """The slot's output area up to the padded stream size."""
    stored: int
    chain: Chain
    slot: int


class _LossyEntry(NamedTuple):
    """A chunk on its way through ``GpuEncoder._encode_bitcomp_lossy``."""

    job: EncodeJob
    slot: int
    data: Any
    """The rounded values (device uint8)."""
    out_offset: int
    """Where the slot's output area starts in the ring's buffer."""
    form: tuple[str, float]
    """(nvCOMP data type, delta)."""
    check_offset: int | None
    """Where in the ring the check decodes (the slot's free input area), or None: the
    verification buffer."""


class GpuEncoder(WorkerOwner, Encoder):
    """nvCOMP on one device (see the module docstring). ``device``: the backend (default
    ``CudaDevice(device_id)``; tests pass a NumPy stand-in)."""

    name = "gpu"

    def __init__(self, sources: list[ArraySource], *, codec: str, byte_planes: str, device_id: int,
                 chunk_bytes: int, max_staging_bytes: int, batch_chunks: int = BATCH_CHUNKS, timeout: float = 600.0,
                 device: DeviceBackend | None = None, fit_chunk: bool = False):
        if codec != "none" and codec not in gpu_codec_names():
            raise ValueError(f"codec {codec!r} has no GPU implementation (expected one of: "
                             f"{', '.join(['none', *gpu_codec_names()])})")
        self.device = device = backend_or_cuda(device, device_id)
        self.sources = sources
        self.codec = codec
        self.byte_planes = byte_planes
        self.device_id = device_id
        self.chunk_bytes = chunk_bytes
        self.max_staging_bytes = max_staging_bytes
        self.timeout = timeout
        self._rounded = [isinstance(source, RoundedArraySource) for source in sources]
        """Which sources ``save(lossy=...)`` rounded: asked once per source here, since an
        ``isinstance`` on a runtime-checkable protocol costs microseconds, and the worker would
        otherwise ask it for every chunk group."""
        # Bitcomp lossy replaces only GPU-only codecs: a portable codec was chosen to be portable.
        self._lossy_bitcomp = codec not in PORTABLE_CODECS and any(
            rounded and bitcomp_data_type(source) is not None for source, rounded in zip(sources, self._rounded))
        self.ring: StagingRing | None = None
        self.fit_chunk = fit_chunk
        """Whether ``chunk_bytes`` may shrink to fit the budget (``_fit``): for a caller that plans
        its chunks after making the encoder, with ``chunk_bytes`` as it is then (``api.saving``)."""
        try:
            with device.on_stream():
                self._allocate()
        except BaseException:
            device.close()  # codecs made for the bounds: destroyed here, not by the collector
            raise
        self._decisions: dict[int, tuple[bool, str | None]] = {}
        self._batch_slots: list[int] = []
        """Slots acquired by the batch being encoded and not yet handed to the driver."""
        self._worker = BatchWorker("gdsckpt-gpu-encode", device.use_in_thread, self._encode_batch,
                                   batch_size=batch_chunks, timeout=timeout)
        self._closed = False

    def _allocate(self) -> None:
        """Fit the chunk size to the budget (``_fit``), then allocate the ring and the buffers of
        the byte-plane trial and the Bitcomp lossy check (on the device's stream)."""
        device, codec = self.device, self.codec
        trials = codec not in ("none", "ans") or any(self._rounded)
        with_trial = bool(self.sources) and codec != "none" and self.byte_planes == "auto" and trials
        slots = self._fit(with_trial)
        chunk_bytes = self.chunk_bytes
        # No more slots than the save can have chunks (each array's own chunks; packing only makes
        # fewer): a small state does not take the whole budget.
        most = sum(max(1, -(-source.nbytes // chunk_bytes)) for source in self.sources if source is not None)
        slots = max(1, min(slots, most))
        self.max_pending = slots
        self.staging_bytes = 0
        if self.sources:
            self.ring = StagingRing(device, slots, chunk_bytes, self._out_bytes, timeout=self.timeout)
            self.staging_bytes = self.ring.nbytes
        self._trial_scratch: Any = None
        if with_trial:
            self._trial_scratch = device.empty(self._trial_bytes + 2 * self._trial_out)
            self.staging_bytes += self._trial_scratch.nbytes
        self._verify: Any = device.empty(chunk_bytes) if self._lossy_bitcomp else None
        if self._verify is not None:
            self.staging_bytes += chunk_bytes

    def _fit(self, with_trial: bool) -> int:
        """Choose ``chunk_bytes`` and the output areas, return the ring's slot count.

        Everything the encoder allocates shares ``STAGING_RING_SHARE`` of ``max_staging_bytes``:
        nvCOMP's scratch (``ENCODE_SCRATCH``, part of it growing with the chunk size), the byte-plane
        trial's buffer, the Bitcomp lossy check's buffer and at least two ring slots (one filling,
        one being written). With ``fit_chunk``, where they do not fit at the chunk size asked for,
        the chunks are halved until they do (down to ``MIN_FITTED_CHUNK_BYTES``): the file then
        has smaller chunks, which any reader reads, and the save keeps its bound. A budget
        that holds no two slots even then is a ``ValueError`` naming the least that would:
        nvCOMP's Zstd under the default 1 GiB, for one (its scratch, about 1.1 GiB, is the same
        for every chunk size: ``ENCODE_SCRATCH``).
        Without ``fit_chunk`` (chunks planned already) the ring keeps two slots whatever the
        budget."""
        codec = self.codec
        probing = bool(self.sources) and codec != "none"
        chunk_bytes = self.chunk_bytes
        while True:
            # Output areas of the chunk size are a lower bound of nvCOMP's: a size that cannot fit
            # even so is passed over without allocating a probe of it (which could exceed the
            # budget by itself); one that might fit is measured with a probe of its size.
            needed, slots = self._layout(None, chunk_bytes, with_trial)
            if probing and (slots >= 2 or not self.fit_chunk or chunk_bytes <= MIN_FITTED_CHUNK_BYTES):
                needed, slots = self._measured_layout(chunk_bytes, with_trial)
            if slots >= 2 or not self.fit_chunk or chunk_bytes <= MIN_FITTED_CHUNK_BYTES or not self.sources:
                break
            chunk_bytes = max(MIN_FITTED_CHUNK_BYTES, align_up(chunk_bytes // 2))
        if slots < 2 and self.sources and self.fit_chunk:
            # a codec with a CPU implementation is what engine="auto" compresses on the CPU instead
            instead = (f" (or engine='auto': the CPU engine compresses CUDA state with {codec} within its own bounds)"
                       if codec in PORTABLE_CODECS else "")
            raise ValueError(f"max_staging_bytes={self.max_staging_bytes} cannot hold two staging slots and "
                             f"nvCOMP's {codec} scratch even with {chunk_bytes}-byte chunks: it needs at least "
                             f"{needed} bytes{instead}")
        if chunk_bytes != self.chunk_bytes:
            _log.info("GPU chunks of %d bytes instead of %d: %s's staging fits max_staging_bytes=%d only then",
                      chunk_bytes, self.chunk_bytes, codec, self.max_staging_bytes)
        self.chunk_bytes = chunk_bytes
        return max(2, slots) if self.sources else 2

    def _measured_layout(self, chunk_bytes: int, with_trial: bool) -> tuple[int, int]:
        """``_layout`` with nvCOMP's bounds, from a probe of ``chunk_bytes`` released at once."""
        probe = self.device.empty(chunk_bytes)
        try:
            return self._layout(probe, chunk_bytes, with_trial)
        finally:
            del probe

    def _layout(self, probe: Any, chunk_bytes: int, with_trial: bool) -> tuple[int, int]:
        """Set the output areas for chunks of ``chunk_bytes`` from nvCOMP's bounds (``probe``:
        a device buffer at least that long, None for ``codec="none"``); return the least budget
        that holds two slots, and the slots that fit ``max_staging_bytes``."""
        device, codec = self.device, self.codec
        self._trial_bytes = min(TRIAL_BYTES, chunk_bytes)
        self._out_bytes, self._trial_out = chunk_bytes, self._trial_bytes
        if probe is not None:
            sample = probe[:chunk_bytes]
            bound = device.codec(codec).max_compressed_bytes(sample)
            if self._lossy_bitcomp:
                bound = max(bound, *(device.codec("bitcomp", data_type, 1.0).max_compressed_bytes(sample)
                                     for data_type in BITCOMP_LOSSY_TYPES.values()))
            self._out_bytes = align_up(max(bound, chunk_bytes))
            trial_bound = device.codec(codec).max_compressed_bytes(probe[:self._trial_bytes])
            self._trial_out = align_up(max(trial_bound, self._trial_bytes))
        fixed, per_chunk = encode_scratch([codec] + ["bitcomp"] * self._lossy_bitcomp, chunk_bytes)
        fixed += chunk_bytes * self._lossy_bitcomp  # the check's decode buffer
        fixed += (self._trial_bytes + 2 * self._trial_out) if with_trial else 0
        slot = chunk_bytes + self._out_bytes
        needed = math.ceil((fixed + 2 * (slot + per_chunk)) / STAGING_RING_SHARE)
        return needed, slots_that_fit(self.max_staging_bytes, slot, (fixed, per_chunk))

    # -- interface ---------------------------------------------------------------------------
    def submit_encode(self, chunk: ChunkPlan) -> Future[EncodedChunk]:
        """Queue ``chunk`` for the worker; the future completes once its payload is ready."""
        future: Future[EncodedChunk] = Future()
        self._worker.submit(EncodeJob(chunk, future))
        return future

    def close(self) -> None:
        """``WorkerOwner.close``, and the trial and check buffers go too."""
        super().close()
        self._trial_scratch = self._verify = None

    # -- helpers -----------------------------------------------------------------------------
    def _acquire(self) -> int:
        slot = self.ring.acquire()  # type: ignore[union-attr]  # a chunk implies sources, hence a ring
        self._batch_slots.append(slot)
        return slot

    def _release(self, slot: int) -> None:
        self.ring.release(slot)  # type: ignore[union-attr]

    def _bitcomp_form(self, chunk: ChunkPlan) -> tuple[str, float] | None:
        """(data type, delta) when the chunk goes to Bitcomp's lossy mode: one part of one
        eligible array (a pack of several arrays has several grids), a GPU-only codec."""
        if not self._lossy_bitcomp or len(chunk.parts) != 1 or chunk.delta:
            return None
        source = self.sources[chunk.parts[0].array]
        data_type = bitcomp_data_type(source)
        if data_type is None or not isinstance(source, RoundedArraySource):
            return None
        return data_type, source.rounding.step

    def _has_rounded(self, chunk: ChunkPlan) -> bool:
        return any(self._rounded[p.array] for p in chunk.parts)

    def _on_device(self, chunk: ChunkPlan) -> bool:
        return all(self.sources[p.array].on_device for p in chunk.parts)

    def _device_view(self, chunk: ChunkPlan) -> bool:
        """Whether the chunk is one range of one source's device memory, so that its bytes can be
        read in place. Not so for bytes a source computes (a delta's XOR with its base, a range
        of a non-contiguous tensor): each is a new chunk-sized array, and held until its batch is
        compressed they would take up to a chunk per slot beyond ``max_staging_bytes``; they are
        copied into the slot instead, one at a time."""
        if len(chunk.parts) != 1 or not self._on_device(chunk):
            return False
        part = chunk.parts[0]
        span = getattr(self.sources[part.array], "device_span", None)
        return span is not None and span(part.start, part.stop) is not None

    def _gather(self, chunk: ChunkPlan, into: Any) -> Any:
        """The chunk's bytes on the device: a view of the source when it is one device range and
        ``into`` is None, else copied into ``into`` (host ranges with an asynchronous copy on the
        stream)."""
        if into is None and len(chunk.parts) == 1 and self._on_device(chunk):  # a view (or, lossy, a rounded copy)
            part = chunk.parts[0]
            return self.sources[part.array].device_bytes(part.start, part.stop)
        position = 0
        small: list[tuple[int, int, int]] = []  # (device address, position in ``into``, length)
        for part in chunk.parts:
            source = self.sources[part.array]
            length = part.stop - part.start
            span = getattr(source, "device_span", None) if source.on_device and length <= GATHER_KERNEL_BYTES else None
            address = span(part.start, part.stop) if span is not None else None
            if address is not None:
                small.append((address, position, length))
            elif source.on_device:
                into[position:position + length] = source.device_bytes(part.start, part.stop)
            else:
                self.device.upload(into[position:position + length], source.host_bytes(part.start, part.stop))
            position += length
        if small:
            self.device.gather(small, into)
        return into[:position]

    def _decide(self, chunk: ChunkPlan, data: Any) -> tuple[bool, str | None]:
        """Byte planes or not, and the ANS data type, for the chunk's group.

        For floats ANS takes its typed mode and no planes (``codecs.device.ANS_DATA_TYPES``;
        planes gain nothing over the typed mode there). Two kinds of chunk are no longer
        float-like: XORs with a base take planes and bytes-mode ANS, and values rounded by
        ``lossy=`` are decided by a trial. For the LZ-family codecs, a trial compresses a sample
        both ways and keeps the smaller.
        """
        cached = self._decisions.get(chunk.decision_group)
        if cached is not None:
            return cached
        width = chunk.plane_width
        if self.codec == "ans" and chunk.delta and width and self.byte_planes != "never":
            # XORs with a base are no floats: mostly zero high bytes, noisy low ones. Byte planes
            # and bytes-mode ANS code those apart (typed ANS on XORs of bf16 weights: 1.28x
            # smaller than the weights' own stream; planes + ANS on XORs 10 steps apart: 9-10x,
            # docs/performance.md).
            decision: tuple[bool, str | None] = (True, None)
        elif self.codec == "ans" and width and self.byte_planes == "auto" and self._has_rounded(chunk):
            # Values rounded by save(lossy=...) sit on a grid or have cleared low mantissa bits.
            # Typed ANS models them as floats and gains little (grid 1e-2 on AdamW moments:
            # 1.24x), while each byte plane has few distinct values (order-0 entropy of the
            # planes: 5.3-6.3x on the same kind of data): a trial decides.
            typed = ans_data_type(width)
            decision = (True, None) if self._planes_smaller(data, width, typed) else (False, typed)
        elif self.codec == "ans":
            decision = (False, ans_data_type(width))
        elif width == 0 or self.byte_planes == "never" or self.codec == "none":
            decision = (False, None)
        elif self.byte_planes == "always":
            decision = (True, None)
        else:
            decision = (self._planes_smaller(data, width, None), None)
        self._decisions[chunk.decision_group] = decision
        return decision

    def _planes_smaller(self, data: Any, width: int, plain_type: str | None) -> bool:
        """The trial of ``_decide``: whether a sample of ``data`` (its first ``TRIAL_BYTES``)
        codes smaller as byte planes in bytes mode than as it is, coded with ``plain_type``
        (ANS's typed mode; None for the LZ family). Uses the trial scratch: the planes at its
        start, the two streams after them."""
        scratch = self._trial_scratch
        sample = data[: min(data.nbytes, self._trial_bytes) // width * width]
        planed = planes_forward_into(sample, scratch[:self._trial_bytes], width)
        plain = self.device.codec(self.codec, plain_type).encode_into(
            [sample], scratch, [self._trial_bytes], self._trial_out)[0]
        as_planes = self.device.codec(self.codec, None).encode_into(
            [planed], scratch, [self._trial_bytes + self._trial_out], self._trial_out)[0]
        return as_planes < plain

    # -- the worker's batch --------------------------------------------------------------------
    def _encode_batch(self, jobs: list[EncodeJob]) -> None:
        for job in jobs:
            if job.chunk.raw > self.chunk_bytes:
                raise ValueError(f"chunk of {job.chunk.raw} bytes exceeds the staging slot ({self.chunk_bytes})")
        device = self.device
        self._batch_slots = []
        try:
            with device.on_stream():
                lossy: list[EncodeJob] = []
                plain: list[EncodeJob] = []
                for job in jobs:
                    (plain if self._bitcomp_form(job.chunk) is None else lossy).append(job)
                results, fallback = self._encode_bitcomp_lossy(lossy) if lossy else ([], [])
                results += self._encode_codec(plain + fallback)
                device.zero_fill([r.padded[r.stored:] for r in results if r.padded.nbytes > r.stored])
                crcs = device.crc32c([r.padded[:r.stored] for r in results])  # synchronizes the stream
        except BaseException:
            # The batch fails as a whole (``BatchWorker`` delivers the error): its slots return
            # once the stream is idle. A device too broken to synchronize has its own error
            # raised elsewhere; the one that failed the batch is what the chunks report.
            with contextlib.suppress(Exception):
                device.synchronize()
            for slot in self._batch_slots:
                self._release(slot)
            raise
        finally:
            self._batch_slots = []
        for result, crc in zip(results, crcs):
            try:
                result.job.future.set_result(EncodedChunk(result.padded, result.stored, result.job.chunk.raw,
                                                          int(crc), result.chain,
                                                          release=partial(self._release, result.slot)))
            except InvalidStateError:  # cancelled by a save that failed meanwhile: nobody writes it
                self._release(result.slot)

    def _encode_codec(self, jobs: list[EncodeJob]) -> list[_Encoded]:
        """Gather, transform and compress chunks with the encoder's codec, on the stream,
        unsynchronized."""
        ring = self.ring
        assert ring is not None
        prepared = []
        for job in jobs:
            chunk = job.chunk
            slot = self._acquire()
            slot_in, slot_out = ring.first(slot), ring.second(slot)
            direct = self._device_view(chunk)
            data = self._gather(chunk, None if direct else slot_out)
            use_planes, data_type = self._decide(chunk, data)
            if use_planes:
                data = planes_forward_into(data, slot_in, chunk.plane_width)
            elif not direct:
                slot_in[:data.nbytes] = data
                data = slot_in[:data.nbytes]
            prepared.append((job, slot, data, use_planes, data_type))
        sizes: list[int | None] = [None] * len(prepared)
        codecs: list[DeviceCodecLike | None] = [None] * len(prepared)
        if self.codec != "none":
            groups: dict[str | None, list[int]] = {}
            for i, entry in enumerate(prepared):
                groups.setdefault(entry[4], []).append(i)
            for data_type, members in groups.items():
                codec = self.device.codec(self.codec, data_type)
                got = codec.encode_into([prepared[i][2] for i in members], ring.buffer,
                                        [ring.second_offset(prepared[i][1]) for i in members], self._out_bytes)
                for i, size in zip(members, got):
                    sizes[i], codecs[i] = size, codec
        results = []
        for (job, slot, _data, use_planes, _type), size, codec in zip(prepared, sizes, codecs):
            chunk, slot_out = job.chunk, ring.second(slot)
            if size is None or codec is None or size >= chunk.raw:
                # Incompressible (or codec "none"): store the untransformed bytes.
                original = self._gather(chunk, None if self._device_view(chunk) else slot_out)
                if self.device.address(original) != self.device.address(slot_out):
                    slot_out[:original.nbytes] = original
                stored, chain = chunk.raw, NONE_CHAIN
            else:
                stored = size
                stages = [{"name": BYTE_PLANES.name, "width": chunk.plane_width}] if use_planes else []
                chain = Chain.of(*stages, codec.stage())
            results.append(_Encoded(job, slot_out[:align_up(stored)], stored, chain, slot))
        return results

    def _encode_bitcomp_lossy(self, jobs: list[EncodeJob]) -> tuple[list[_Encoded], list[EncodeJob]]:
        """Code chunks of grid-rounded arrays with Bitcomp's lossy mode (module docstring).
        Returns the results and the jobs that must take the codec's path: their streams did not
        decode to the rounded values or did not shrink (their slots released)."""
        ring, device = self.ring, self.device
        assert ring is not None
        entries = []
        for job in jobs:
            chunk = job.chunk
            slot = self._acquire()
            direct = self._on_device(chunk)  # then the input area stays free: the check decodes there
            data = self._gather(chunk, None if direct else ring.first(slot))
            form = self._bitcomp_form(chunk)
            assert form is not None
            entries.append(_LossyEntry(job, slot, data, ring.second_offset(slot), form,
                                       slot * ring.slot_bytes if direct else None))
        groups: dict[tuple[str, float], list[_LossyEntry]] = {}
        for entry in entries:
            groups.setdefault(entry.form, []).append(entry)
        sizes: dict[int, int] = {}
        checks: dict[int, Any] = {}
        for (data_type, delta), members in groups.items():
            codec = device.codec("bitcomp", data_type, delta)
            got = codec.encode_into([e.data for e in members], ring.buffer, [e.out_offset for e in members],
                                    self._out_bytes)
            sizes.update((e.job.chunk.number, size) for e, size in zip(members, got))
            # Decode every stream again and compare: in one call into the free input areas, or
            # (input gathered there from host memory) one by one into the verification buffer.
            in_place = [e for e in members if e.check_offset is not None]
            calls = ([(in_place, ring.buffer, [e.check_offset for e in in_place if e.check_offset is not None])]
                     if in_place else [])
            calls += [([e], self._verify, [0]) for e in members if e.check_offset is None]
            for targets, buffer, offsets in calls:
                streams = [ring.buffer[e.out_offset:e.out_offset + sizes[e.job.chunk.number]] for e in targets]
                raws = [e.job.chunk.raw for e in targets]
                try:
                    decoded = codec.decode_into(streams, buffer, offsets, raws)
                except (ValueError, RuntimeError):
                    decoded = [-1] * len(targets)
                for entry, offset, raw, length in zip(targets, offsets, raws, decoded):
                    itemsize = self.sources[entry.job.chunk.parts[0].array].itemsize
                    checks[entry.job.chunk.number] = (
                        same_values(device.xp, entry.data, buffer[offset:offset + raw], itemsize)
                        if length == raw else False)
        passed = device.all_true([checks[e.job.chunk.number] for e in entries])  # one synchronization
        results, fallback = [], []
        for entry, ok in zip(entries, passed):
            chunk, size = entry.job.chunk, sizes[entry.job.chunk.number]
            if ok and size < chunk.raw:
                chain = Chain.of(device.codec("bitcomp", *entry.form).stage())
                padded = ring.buffer[entry.out_offset:entry.out_offset + align_up(size)]
                results.append(_Encoded(entry.job, padded, size, chain, entry.slot))
            else:
                if not ok:
                    _log.info("chunk %d: Bitcomp's lossy stream did not decode to the rounded values; "
                              "stored with codec %s", chunk.number, self.codec)
                self._batch_slots.remove(entry.slot)
                self._release(entry.slot)
                fallback.append(entry.job)
        return results, fallback
