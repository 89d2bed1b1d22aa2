"""The GPU engine: the ``Engine`` interface run with nvCOMP batches on a dedicated CUDA stream.

Save: a worker thread (device made current first) takes whatever chunks are queued, up to
``batch_chunks``, gathers each into a slot of a staging ring that is allocated once per engine
(``max_staging_bytes``, never per chunk), applies byte planes on the GPU where they help,
compresses the batch with one nvCOMP call per codec variant, copies the streams into the slots,
zero pads them to 4 KiB, computes their CRC-32C on the GPU (nvCOMP CRC32) and hands the slots to
the writer (kvikio) as payloads. A slot returns to the ring when the save driver reports its
write done (``EncodedChunk.release``); the driver never has more chunks outstanding than there are
slots (``max_pending``), so the worker never waits for a slot that cannot come back.

Restore: the same kind of ring, allocated once per restore (``reserve_reads``) and sized from
the index (one slot holds the largest stored chunk and the largest raw chunk): the reader fills a
slot's read area; the worker checks the CRC-32C on the GPU, decodes each batch with nvCOMP into
the slots' output areas, undoes byte planes on the GPU (into the read area, whose stream is spent)
and copies the bytes into the destination arrays on the same stream, then synchronizes once per
batch and returns the slots. The restore driver keeps no more chunks outstanding than there are
slots, so GPU memory beyond the destination arrays is the ring plus nvCOMP's scratch, whatever the
checkpoint's size.

Lossy arrays: where ``save(lossy=...)`` rounded a float32 / float16 array to its grid and the
save runs a GPU-only codec, its chunks go to nvCOMP Bitcomp's lossy mode instead
(``nvcomp.bitcomp-lossy/1`` with ``delta`` = the grid's step), each stream decoded again at once
and compared with the rounded values (zeros of either sign count as equal, everything else bit
for bit): device chunks of one step in one nvCOMP call into their slots' free input areas (nvCOMP
costs ~5 ms per call through Python, run 19), chunks gathered from host memory one by one into a
verification buffer. A chunk that fails, or does not shrink, takes the codec's path like any
other. The check is what makes the lossy record's ``max_error`` hold for what a
reader gets, whatever Bitcomp's quantizer does at the edges (integer overflow, outliers).

Host sources: an array in host memory (a pinned snapshot of CUDA tensors taken by
``save_async``) is copied into its staging slot on the engine's stream (asynchronous when the
memory is pinned) and compressed there like device data.

Every wait on the worker is bounded by ``timeout``: a dead worker fails the operation instead of
hanging it.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import re
import threading
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple

import numpy as np

from ..codecs import BYTE_PLANES, PORTABLE_CODECS, Chain
from ..codecs.nvcomp import (BITCOMP_LOSSY, BITCOMP_LOSSY_TYPES, BY_VERSIONED, GPU_ALGORITHMS, DeviceCodec,
                             bitcomp_lossy_params)
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ..format import XOR_BASE, align_up
from ..format.index import ChunkRecord
from .engine import NONE_CHAIN, EncodedChunk, Engine
from .plan import ArraySource, ChunkPlan

_log = logging.getLogger(__name__)
TRIAL_BYTES = 1 << 20
STAGING_RING_SHARE = 0.9
"""Share of ``max_staging_bytes`` for the ring and nvCOMP's scratch; the rest covers CRC buffers,
batch descriptors and allocator rounding."""
_SCRATCH_CHUNK = 16 << 20
ENCODE_SCRATCH = {  # codec: (bytes held whatever the batch, bytes per chunk in a batch), 16 MiB chunks
    "ans": (32 << 20, 0), "lz4": (32 << 20, 0), "snappy": (32 << 20, 0), "bitcomp": (32 << 20, 0),
    "cascaded": (32 << 20, 0), "zstd": (1120 << 20, 24 << 20), "deflate": (16 << 20, 146 << 20),
    "gdeflate": (16 << 20, 146 << 20),
}
"""Device memory nvCOMP 6.0 holds beyond our buffers while compressing a batch, measured on the
H200 with ``benchmarks/nvcomp_scratch_probe.py`` (``benchmarks/results/h200-2026-12-02/run5-scratch-probe/``):
the engine subtracts it from the staging budget before sizing its ring, so the ring plus the
scratch stay within ``max_staging_bytes``. Scaled linearly for smaller chunks (an upper bound:
the temporaries grow with the chunk size). nvCOMP's Zstd alone needs more than the 1 GiB default
to compress 16 MiB chunks; the ring then keeps its minimum of two slots and the bound cannot hold
(documented in docs/performance.md)."""
DECODE_SCRATCH = {"zstd/1": (128 << 20, 44 << 20)}
"""The same for decompression, by bitstream name (the others measured 0)."""


def _rounded(source: ArraySource) -> bool:
    """Whether the pipeline reads ``source`` rounded by ``save(lossy=...)`` (a
    ``gdsckpt.lossy.RoundedSource``, told by its ``rounding``)."""
    return getattr(source, "rounding", None) is not None


def _scratch(table: dict[str, tuple[int, int]], names: Any, chunk_bytes: int) -> tuple[int, int]:
    """(fixed, per chunk) scratch for the worst of ``names`` at ``chunk_bytes`` per chunk."""
    scale = min(1.0, chunk_bytes / _SCRATCH_CHUNK)
    fixed = max((table.get(name, (0, 0))[0] for name in names), default=0)
    per_chunk = max((table.get(name, (0, 0))[1] for name in names), default=0)
    return int(fixed * scale), int(per_chunk * scale)


def ring_slots(budget: int, slot_bytes: int, scratch: tuple[int, int], *, most: int | None = None) -> int:
    """Slots of ``slot_bytes`` that fit with ``scratch`` (fixed, per slot) in the ring's share of
    ``budget``: at least 2 (one filling, one draining), at most ``most``."""
    fixed, per_slot = scratch
    slots = max(2, (int(budget * STAGING_RING_SHARE) - fixed) // (slot_bytes + per_slot))
    return slots if most is None else max(1, min(most, slots))
_TYPED_ANS = {2: "<f2", 4: "<f4"}

_ZERO_TAILS = r"""
extern "C" __global__ void zero_tails(unsigned char** starts, const int* lengths) {
    // One block per payload: clear the padding between the stream's end and the next 4 KiB.
    unsigned char* start = starts[blockIdx.x];
    for (int i = threadIdx.x; i < lengths[blockIdx.x]; i += blockDim.x) start[i] = 0;
}
"""
_kernels: dict[int, Any] = {}
_allocator_installed = False
_allocator_lock = threading.Lock()


class _LossyEntry(NamedTuple):
    """A chunk on its way through ``GpuEngine._encode_bitcomp_lossy``."""

    chunk: ChunkPlan
    future: Future[EncodedChunk]
    slot: int
    data: Any
    """The rounded values (CuPy uint8)."""
    out_offset: int
    """Where the slot's output area starts in the staging ring."""
    form: tuple[str, float]
    """(nvCOMP data type, delta)."""
    check_offset: int | None
    """Where in the ring the check decodes (the slot's free input area), or None: the
    verification buffer."""


def _same_values(cupy: Any, expected: Any, decoded: Any, itemsize: int) -> Any:
    """A device boolean: whether ``decoded`` holds the floats of ``expected`` (uint8 arrays of
    ``itemsize``-byte floats): every element bit for bit (NaN payloads, infinities included),
    except that a zero may come back with the other sign (Bitcomp's lossy mode returns +0.0)."""
    unsigned = {4: cupy.uint32, 2: cupy.uint16}[itemsize]
    magnitude = (1 << (8 * itemsize - 1)) - 1
    a, b = expected.view(unsigned), decoded.view(unsigned)
    return cupy.all((a == b) | (((a | b) & magnitude) == 0))


NVCOMP_UNDECODABLE = re.compile(r"nvcompErrorCannotDecompress|nvcompErrorBadChecksum|cannot decompress",
                                re.IGNORECASE)
"""How nvCOMP's Python API names the statuses that prove a stream undecodable
(``nvcompErrorCannotDecompress``, 12: corrupt or truncated input; ``nvcompErrorBadChecksum``, 13).
None of the errors measured with nvCOMP 6.0 named one (see ``_decode_on_stream``); an error that
does not is not taken for damage."""


def reports_undecodable(err: BaseException) -> bool:
    """Whether an nvCOMP error reports a stream it cannot decode (proof of damage), as opposed to
    running out of memory, a CUDA or device fault, or anything else it raises ``RuntimeError`` for."""
    return bool(NVCOMP_UNDECODABLE.search(str(err)))


def _decoder_key(stage: dict[str, Any]) -> tuple[str, str | None, float | None]:
    """(bitstream name, data type, delta) that picks the decoder of a chain's codec stage, its
    parameters checked (``ValueError``): they come from the file and key a dict."""
    name = stage["name"]
    if name == BITCOMP_LOSSY:
        return (name, *bitcomp_lossy_params(stage))
    data_type = stage.get("data_type")
    if data_type is not None and not isinstance(data_type, str):
        raise ValueError(f"{name} stage has data_type {data_type!r}, expected a string")
    return name, data_type, None


def _zero_tails_kernel(cupy: Any) -> Any:
    device = cupy.cuda.runtime.getDevice()
    if device not in _kernels:
        _kernels[device] = cupy.RawKernel(_ZERO_TAILS, "zero_tails")
    return _kernels[device]


def install_nvcomp_allocator() -> None:
    """Route nvCOMP's own device allocations (scratch, temporaries) to CuPy's memory pool.

    Without it nvCOMP calls cudaMalloc/cudaFree around each batch, which costs time and keeps its
    memory outside any bound we can see; with it the memory is pooled, reused across batches,
    and counted by ``cupy.get_default_memory_pool()``. Process-wide, installed once.

    Opt-in (``GDSCKPT_NVCOMP_ALLOCATOR=1``): on the H200 host (nvCOMP 6.0.0, CuPy 14.2) every
    process that used it passed its work and then crashed with SIGSEGV at interpreter exit
    (nvCOMP's global allocator outlives the Python callable it holds). Resetting it with
    ``set_device_allocator(None)`` before exit avoided the crash in a probe
    (``benchmarks/nvcomp_scratch_probe.py``), so an exit hook does that here; off by default
    until the whole GPU suite has run with it.
    """
    global _allocator_installed
    with _allocator_lock:
        if _allocator_installed or os.environ.get("GDSCKPT_NVCOMP_ALLOCATOR", "0") != "1":
            return
        import cupy
        from nvidia import nvcomp

        def allocate(nbytes: int, stream: Any) -> Any:
            # CuPy's pool is stream-ordered on the current stream, which is the engine's stream
            # wherever nvCOMP runs on our behalf.
            return cupy.cuda.alloc(nbytes)

        nvcomp.set_device_allocator(allocate)
        # Registered after CuPy's and nvCOMP's imports, so it runs before their exit hooks.
        atexit.register(nvcomp.set_device_allocator, None)
        _allocator_installed = True


class GpuEngine(Engine):
    """nvCOMP on one CUDA device; see the module docstring."""

    name = "gpu"

    def __init__(self, sources: list[ArraySource], *, codec: str, byte_planes: str, device_id: int,
                 chunk_bytes: int, max_staging_bytes: int, batch_chunks: int = 64, timeout: float = 600.0):
        import cupy

        if codec != "none" and codec not in GPU_ALGORITHMS:
            raise ValueError(f"codec {codec!r} has no GPU implementation (expected one of: "
                             f"{', '.join(['none', *GPU_ALGORITHMS])})")
        install_nvcomp_allocator()
        self.cupy = cupy
        self.sources = sources
        self.codec = codec
        self.byte_planes = byte_planes
        self.device_id = device_id
        self.chunk_bytes = chunk_bytes
        self.batch_chunks = batch_chunks
        self.timeout = timeout
        self._codecs: dict[tuple[str, str | None, float | None], DeviceCodec] = {}
        # Bitcomp lossy replaces only GPU-only codecs: a portable codec was chosen to be portable.
        self._lossy_bitcomp = codec not in PORTABLE_CODECS and any(
            self._bitcomp_type(source) is not None for source in sources)
        try:
            with cupy.cuda.Device(device_id):
                self.stream = cupy.cuda.Stream(non_blocking=True)
                self._out_bytes = chunk_bytes
                self._trial_out = TRIAL_BYTES
                if sources and codec != "none":
                    with self.stream:
                        probe = cupy.empty(chunk_bytes, dtype=cupy.uint8)
                        bound = self._codec(codec, None).max_compressed_bytes(probe)
                        trial_bound = self._codec(codec, None).max_compressed_bytes(probe[:TRIAL_BYTES])
                        if self._lossy_bitcomp:
                            bound = max(bound, *(
                                self._codec("bitcomp", data_type, 1.0).max_compressed_bytes(probe)
                                for data_type in BITCOMP_LOSSY_TYPES.values()))
                        del probe
                    self._out_bytes = align_up(max(bound, chunk_bytes))
                    self._trial_out = align_up(max(trial_bound, TRIAL_BYTES))
                self._slot_bytes = chunk_bytes + self._out_bytes
                # The ring and nvCOMP's scratch share 90% of the budget (see ENCODE_SCRATCH); the
                # Bitcomp lossy check's decode buffer (one chunk) comes out of the fixed part.
                fixed, per_chunk = _scratch(ENCODE_SCRATCH, [codec] + ["bitcomp"] * self._lossy_bitcomp,
                                            chunk_bytes)
                slots = ring_slots(max_staging_bytes, self._slot_bytes,
                                   (fixed + chunk_bytes * self._lossy_bitcomp, per_chunk))
                self.max_pending = slots
                self.staging_bytes = slots * self._slot_bytes if sources else 0
                self._staging: Any = None if not sources else cupy.empty(self.staging_bytes, dtype=cupy.uint8)
                self._scratch: Any = None
                trials = codec not in ("none", "ans") or any(_rounded(source) for source in sources)
                if sources and codec != "none" and byte_planes == "auto" and trials:
                    self._scratch = cupy.empty(TRIAL_BYTES + 2 * self._trial_out, dtype=cupy.uint8)
                self._verify: Any = cupy.empty(chunk_bytes, dtype=cupy.uint8) if self._lossy_bitcomp else None
        except BaseException:
            if hasattr(self, "stream"):
                self._close_codecs()  # made for the bounds; destroyed here, not by the collector
            raise
        self.max_staging_bytes = max_staging_bytes
        self._free_slots: queue.Queue[int] = queue.Queue()
        for slot in range(slots if sources else 0):
            self._free_slots.put(slot)
        self._read_area = 0
        self._read_slots: dict[int, int] = {}
        """Device pointer of a handed-out read buffer -> its restore slot."""
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._decisions: dict[int, tuple[bool, str | None]] = {}
        self._worker: threading.Thread | None = None
        self._closed = False

    # -- worker ----------------------------------------------------------------------------
    def _start(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="gdsckpt-gpu", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        self.cupy.cuda.Device(self.device_id).use()  # a new thread has no current device
        while True:
            job = self._jobs.get()
            if job is None:
                return
            batch = [job]
            while len(batch) < self.batch_chunks:
                try:
                    extra = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if extra is None:
                    self._jobs.put(None)
                    break
                batch.append(extra)
            encodes = [j for j in batch if j[0] == "encode"]
            decodes = [j for j in batch if j[0] == "decode"]
            for jobs, handler in ((encodes, self._encode_batch), (decodes, self._decode_batch)):
                if not jobs:
                    continue
                try:
                    handler(jobs)
                except BaseException as err:  # noqa: BLE001 - delivered to every waiting future
                    for job_ in jobs:
                        if not job_[-1].done():
                            job_[-1].set_exception(err)

    def _close_codecs(self) -> None:
        """Destroy every nvCOMP codec now, on this thread, not when the collector finds them."""
        codecs = list(self._codecs.values())
        self._codecs.clear()
        with self.cupy.cuda.Device(self.device_id):
            for codec in codecs:
                codec.close()

    def _codec(self, user_name: str, data_type: str | None, delta: float | None = None) -> DeviceCodec:
        key = (user_name, data_type, delta)
        codec = self._codecs.get(key)
        if codec is None:
            codec = self._codecs[key] = DeviceCodec(user_name, stream=self.stream, device_id=self.device_id,
                                                    data_type=data_type, delta=delta)
        return codec

    # -- save ------------------------------------------------------------------------------
    def submit_encode(self, chunk: ChunkPlan) -> Future[EncodedChunk]:
        future: Future[EncodedChunk] = Future()
        self._start()
        self._jobs.put(("encode", chunk, future))
        return future

    def _release(self, slot: int) -> None:
        self._free_slots.put(slot)

    @staticmethod
    def _bitcomp_type(source: ArraySource) -> str | None:
        """nvCOMP data type under which Bitcomp's lossy mode may code ``source``: arrays rounded
        to a grid by ``save(lossy=...)`` (policy ``bitcomp`` on), float32 or float16."""
        rounding = getattr(source, "rounding", None)
        if rounding is None or rounding.mode != "grid" or not rounding.bitcomp:
            return None
        return BITCOMP_LOSSY_TYPES.get(getattr(source, "dtype", None))

    def _bitcomp_form(self, chunk: ChunkPlan) -> tuple[str, float] | None:
        """(data type, delta) when the chunk goes to Bitcomp's lossy mode: one part of one
        eligible array (a pack of several arrays has several grids), a GPU-only codec."""
        if not self._lossy_bitcomp or len(chunk.parts) != 1 or chunk.delta:
            return None
        source = self.sources[chunk.parts[0].array]
        data_type = self._bitcomp_type(source)
        return None if data_type is None else (data_type, source.rounding.step)  # type: ignore[attr-defined]

    def _has_rounded(self, chunk: ChunkPlan) -> bool:
        return any(_rounded(self.sources[p.array]) for p in chunk.parts)

    def _on_device(self, chunk: ChunkPlan) -> bool:
        return all(self.sources[p.array].on_device for p in chunk.parts)

    def _gather(self, chunk: ChunkPlan, into: Any) -> Any:
        """The chunk's bytes on the device: a view of the source when it is one device range and
        ``into`` is None, else copied into ``into`` (host ranges with an asynchronous copy on the
        engine's stream)."""
        if into is None and len(chunk.parts) == 1 and self._on_device(chunk):
            part = chunk.parts[0]
            return self.sources[part.array].device_bytes(part.start, part.stop)
        position = 0
        for part in chunk.parts:
            source = self.sources[part.array]
            length = part.stop - part.start
            if source.on_device:
                into[position:position + length] = source.device_bytes(part.start, part.stop)
            else:
                into[position:position + length].set(source.host_bytes(part.start, part.stop),
                                                     stream=self.stream)
            position += length
        return into[:position]

    def _planes(self, data: Any, out: Any, width: int) -> Any:
        count = data.nbytes // width
        view = out[:data.nbytes].reshape(width, count)
        view[...] = data.reshape(count, width)[:, ::-1].T
        return out[:data.nbytes]

    def _decide(self, chunk: ChunkPlan, data: Any) -> tuple[bool, str | None]:
        """Byte planes or not, and the ANS data type, for the chunk's group.

        For floats ANS takes its typed mode and no planes (bf16 N(0, 0.02): 1.51 with ``<f2``
        against 1.28 as bytes; fp32: 1.20 with ``<f4`` against 1.09, measured on the H200; planes
        gain nothing over the typed mode there). Two kinds of chunk are no longer float-like:
        XORs with a base take planes and bytes-mode ANS, and values rounded by ``lossy=`` are
        decided by a trial. For the LZ-family codecs, a trial compresses a sample both ways and
        keeps the smaller.
        """
        cached = self._decisions.get(chunk.decision_group)
        if cached is not None:
            return cached
        width = chunk.plane_width
        if self.codec == "ans" and chunk.delta and width and self.byte_planes != "never":
            # XORs with a base are no floats: mostly zero high bytes, noisy low ones. Byte planes
            # and bytes-mode ANS code those apart (typed ANS on XORs of bf16 weights: 1.28x
            # smaller than the weights' own stream; Zstd with planes: 2.3x; GPU_HOST.md: 9-10x
            # for planes + ANS on XORs 10 steps apart).
            decision: tuple[bool, str | None] = (True, None)
        elif self.codec == "ans" and width and self.byte_planes == "auto" and self._has_rounded(chunk):
            # Values rounded by save(lossy=...) sit on a grid or have cleared low mantissa bits.
            # Typed ANS models them as floats and gains little (grid 1e-2 on AdamW moments: 1.24x
            # on the H200, run 11), while each byte plane has few distinct values (order-0
            # entropy of the planes: 5.3-6.3x on the same kind of data): a trial decides.
            typed = _TYPED_ANS.get(width)
            decision = (True, None) if self._planes_smaller(data, width, typed) else (False, typed)
        elif self.codec == "ans":
            decision = (False, _TYPED_ANS.get(width))
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
        sample = data[: min(data.nbytes, TRIAL_BYTES) // width * width]
        planed = self._planes(sample, self._scratch[:TRIAL_BYTES], width)
        plain = self._codec(self.codec, plain_type).encode_into(
            [sample], self._scratch, [TRIAL_BYTES], self._trial_out)[0]
        as_planes = self._codec(self.codec, None).encode_into(
            [planed], self._scratch, [TRIAL_BYTES + self._trial_out], self._trial_out)[0]
        return as_planes < plain

    def _encode_batch(self, jobs: list[Any]) -> None:
        cupy = self.cupy
        from ..codecs.gpu_crc import crc32c_batch

        for _kind, chunk, _future in jobs:
            if chunk.raw > self.chunk_bytes:
                raise ValueError(f"chunk of {chunk.raw} bytes exceeds the staging slot")
        with self.stream:
            lossy: list[Any] = []
            plain: list[Any] = []
            for job in jobs:
                (plain if self._bitcomp_form(job[1]) is None else lossy).append(job)
            results, fallback = self._encode_bitcomp_lossy(lossy) if lossy else ([], [])
            results += self._encode_codec(plain + fallback)
            payloads = [padded[:stored] for _future, padded, stored, _raw, _chain, _slot in results]
            tails = [(p.data.ptr + p.nbytes, r[1].nbytes - p.nbytes) for p, r in zip(payloads, results)
                     if r[1].nbytes > p.nbytes]
            if tails:
                starts = cupy.asarray(np.array([t[0] for t in tails], dtype=np.uint64))
                lengths = cupy.asarray(np.array([t[1] for t in tails], dtype=np.int32))
                _zero_tails_kernel(cupy)((len(tails),), (256,), (starts, lengths))
            crcs = crc32c_batch(payloads, self.stream)  # synchronizes the stream
        for (future, payload, stored, raw, chain, slot), crc in zip(results, crcs):
            future.set_result(EncodedChunk(payload, stored, raw, int(crc), chain,
                                           release=lambda s=slot: self._release(s)))

    def _slot(self) -> tuple[int, Any, Any, int]:
        """A free staging slot: (number, input area, output area, output area's offset)."""
        slot = self._free_slots.get(timeout=self.timeout)
        base = slot * self._slot_bytes
        out_offset = base + self.chunk_bytes
        return (slot, self._staging[base:base + self.chunk_bytes],
                self._staging[out_offset:out_offset + self._out_bytes], out_offset)

    def _encode_bitcomp_lossy(self, jobs: list[Any]) -> tuple[list[Any], list[Any]]:
        """Code chunks of grid-rounded arrays with Bitcomp's lossy mode (module docstring).
        Returns the results (as ``_encode_codec``'s) and the jobs that must take the codec's path:
        their streams did not decode to the rounded values or did not shrink (slots released)."""
        cupy = self.cupy
        entries = []
        for _kind, chunk, future in jobs:
            slot, slot_in, _slot_out, out_offset = self._slot()
            direct = self._on_device(chunk)  # then the input area stays free: the check decodes there
            data = self._gather(chunk, None if direct else slot_in)
            entries.append(_LossyEntry(chunk, future, slot, data, out_offset, self._bitcomp_form(chunk),  # type: ignore[arg-type]
                                       out_offset - self.chunk_bytes if direct else None))
        groups: dict[tuple[str, float], list[_LossyEntry]] = {}
        for entry in entries:
            groups.setdefault(entry.form, []).append(entry)
        sizes: dict[int, int] = {}
        checks: dict[int, Any] = {}
        for (data_type, delta), members in groups.items():
            codec = self._codec("bitcomp", data_type, delta)
            got = codec.encode_into([e.data for e in members], self._staging, [e.out_offset for e in members],
                                    self._out_bytes)
            sizes.update((e.chunk.number, size) for e, size in zip(members, got))
            # Decode every stream again and compare: in one call into the free input areas, or
            # (input gathered there from host memory) one by one into the verification buffer.
            in_place = [e for e in members if e.check_offset is not None]
            calls = [(in_place, self._staging, [e.check_offset for e in in_place])] if in_place else []
            calls += [([e], self._verify, [0]) for e in members if e.check_offset is None]
            for targets, buffer, offsets in calls:
                streams = [self._staging[e.out_offset:e.out_offset + sizes[e.chunk.number]] for e in targets]
                raws = [e.chunk.raw for e in targets]
                try:
                    decoded = codec.decode_into(streams, buffer, offsets, raws)
                except (ValueError, RuntimeError):
                    decoded = [-1] * len(targets)
                for entry, offset, raw, length in zip(targets, offsets, raws, decoded):
                    itemsize = self.sources[entry.chunk.parts[0].array].itemsize
                    checks[entry.chunk.number] = (
                        _same_values(cupy, entry.data, buffer[offset:offset + raw], itemsize) if length == raw
                        else cupy.zeros((), dtype=cupy.bool_))
        passed = cupy.stack([checks[e.chunk.number] for e in entries]).get()  # one synchronization
        results, fallback = [], []
        for entry, ok in zip(entries, passed):
            chunk, size = entry.chunk, sizes[entry.chunk.number]
            if ok and size < chunk.raw:
                chain = Chain.of(self._codec("bitcomp", *entry.form).stage())
                results.append((entry.future, self._staging[entry.out_offset:entry.out_offset + align_up(size)],
                                size, chunk.raw, chain, entry.slot))
            else:
                if not ok:
                    _log.info("chunk %d: Bitcomp's lossy stream did not decode to the rounded values; "
                              "stored with codec %s", chunk.number, self.codec)
                self._release(entry.slot)
                fallback.append(("encode", chunk, entry.future))
        return results, fallback

    def _encode_codec(self, jobs: list[Any]) -> list[Any]:
        """Gather, transform and compress chunks with the engine's codec; returns (future, padded
        payload, stored size, raw size, chain, slot) per chunk, on the stream, unsynchronized."""
        prepared = []
        for _kind, chunk, future in jobs:
            slot, slot_in, slot_out, out_offset = self._slot()
            direct = len(chunk.parts) == 1 and self._on_device(chunk)
            data = self._gather(chunk, None if direct else slot_out)
            use_planes, data_type = self._decide(chunk, data)
            if use_planes:
                data = self._planes(data, slot_in, chunk.plane_width)
            elif not direct:
                slot_in[:data.nbytes] = data
                data = slot_in[:data.nbytes]
            prepared.append((chunk, future, slot, data, slot_out, out_offset, use_planes, data_type))
        sizes: list[int | None] = [None] * len(prepared)
        codecs: list[DeviceCodec | None] = [None] * len(prepared)
        if self.codec != "none":
            groups: dict[str | None, list[int]] = {}
            for i, entry in enumerate(prepared):
                groups.setdefault(entry[7], []).append(i)
            for data_type, members in groups.items():
                codec = self._codec(self.codec, data_type)
                got = codec.encode_into([prepared[i][3] for i in members], self._staging,
                                        [prepared[i][5] for i in members], self._out_bytes)
                for i, size in zip(members, got):
                    sizes[i], codecs[i] = size, codec
        results = []
        for (chunk, future, slot, data, slot_out, _o, use_planes, _dt), size, codec in zip(prepared, sizes, codecs):
            if size is None or codec is None or size >= chunk.raw:
                # Incompressible (or codec "none"): store the untransformed bytes.
                in_place = len(chunk.parts) == 1 and self._on_device(chunk)
                original = self._gather(chunk, None if in_place else slot_out)
                if original.data.ptr != slot_out.data.ptr:
                    slot_out[:original.nbytes] = original
                stored, chain = chunk.raw, NONE_CHAIN
            else:
                stored = size
                stages = [{"name": BYTE_PLANES.name, "width": chunk.plane_width}] if use_planes else []
                chain = Chain.of(*stages, codec.stage())
            results.append((future, slot_out[:align_up(stored)], stored, chunk.raw, chain, slot))
        return results

    # -- restore ---------------------------------------------------------------------------
    def reserve_reads(self, records: list[ChunkRecord], codecs: Any = ()) -> int | None:
        """Allocate the restore ring for ``records`` and return its slot count (see the module
        docstring). A slot holds the largest padded stored chunk (then, after decoding, a chunk's
        byte-planed raw bytes) and the largest raw chunk; there are as many slots as fit with
        nvCOMP's decode scratch for ``codecs`` (bitstream names) in 90% of ``max_staging_bytes``,
        at least 2 and at most one per chunk."""
        if not records:
            return None
        cupy = self.cupy
        largest_raw = align_up(max(r.raw for r in records))
        self._read_area = max(align_up(max(r.stored for r in records)), largest_raw)
        self._slot_bytes = self._read_area + largest_raw
        slots = ring_slots(self.max_staging_bytes, self._slot_bytes,
                           _scratch(DECODE_SCRATCH, codecs, largest_raw), most=len(records))
        self._staging = None  # a restore's ring replaces any earlier one
        with cupy.cuda.Device(self.device_id):
            self._staging = cupy.empty(slots * self._slot_bytes, dtype=cupy.uint8)
        self.staging_bytes = slots * self._slot_bytes
        self._free_slots = queue.Queue()
        for slot in range(slots):
            self._free_slots.put(slot)
        self._read_slots = {}
        return slots

    def read_buffer(self, nbytes: int) -> Any:
        """A device buffer for a chunk read (kvikio fills it): the read area of a free slot of the
        restore ring, or (no ring reserved) a new array."""
        if self._read_area == 0:
            with self.cupy.cuda.Device(self.device_id):
                return self.cupy.empty(nbytes, dtype=self.cupy.uint8)
        if nbytes > self._read_area:
            raise ValueError(f"read of {nbytes} bytes exceeds the restore slot ({self._read_area})")
        slot = self._free_slots.get(timeout=self.timeout)
        base = slot * self._slot_bytes
        buffer = self._staging[base:base + nbytes]
        self._read_slots[buffer.data.ptr] = slot
        return buffer

    def submit_decode(self, record: ChunkRecord, chain: list[dict[str, Any]], stored: Any,
                      deliver: Callable[[Any], None]) -> Future[None]:
        future: Future[None] = Future()
        self._start()
        self._jobs.put(("decode", record, chain, stored, deliver, future))
        return future

    def _decode_batch(self, jobs: list[Any]) -> None:
        slots = [self._read_slots.pop(job[3].data.ptr, None) for job in jobs]
        delivered: list[Future[None]] = []
        try:
            with self.stream:
                delivered = self._decode_on_stream(jobs, slots)
        finally:
            # The stream is idle (or the batch failed before queueing work on it): the slots'
            # bytes are no longer needed. Returned before any future completes, so a driver that
            # sees a finished decode always finds its slot free.
            self.stream.synchronize()
            for slot in slots:
                if slot is not None:
                    self._free_slots.put(slot)
        for future in delivered:
            future.set_result(None)

    def _slot_areas(self, slot: int | None, raw: int) -> tuple[Any, Any]:
        """(read area, output area) of a restore slot, or new arrays without a ring."""
        if slot is None:
            return (self.cupy.empty(align_up(raw), dtype=self.cupy.uint8),
                    self.cupy.empty(align_up(raw), dtype=self.cupy.uint8))
        base = slot * self._slot_bytes
        return (self._staging[base:base + self._read_area],
                self._staging[base + self._read_area:base + self._slot_bytes])

    def _decode_on_stream(self, jobs: list[Any], slots: list[int | None]) -> list[Future[None]]:
        """Verify, decode and deliver a batch on the engine's stream; returns the futures to
        complete once the stream has finished."""
        cupy = self.cupy
        from ..codecs.gpu_crc import crc32c_batch

        bodies = [stored[:record.stored] for _k, record, _c, stored, _d, _f in jobs]
        crcs = crc32c_batch(bodies, self.stream)
        live = []
        for job, body, crc, slot in zip(jobs, bodies, crcs, slots):
            if int(crc) != job[1].crc:
                job[-1].set_exception(CorruptCheckpointError("chunk checksum mismatch"))
            else:
                live.append((job, body, self._slot_areas(slot, job[1].raw)))
        groups: dict[tuple[str, str | None, float | None], list[int]] = {}
        for i, (job, _body, _areas) in enumerate(live):
            try:
                key = _decoder_key(job[2][-1])
            except ValueError as err:
                job[-1].set_exception(CorruptCheckpointError(f"invalid codec stage: {err}"))
                continue
            groups.setdefault(key, []).append(i)
        raws: list[Any] = [None] * len(live)
        for (name, data_type, delta), members in groups.items():
            if name == "none/1":
                for i in members:
                    raws[i] = live[i][1]
                continue
            if name == BITCOMP_LOSSY:
                user = "bitcomp"
            elif name in BY_VERSIONED:
                user, _algorithm = BY_VERSIONED[name]
            else:
                raise UnsupportedFormatError(f"codec {name!r} is not known to this version of gdsckpt")
            raw_sizes = [live[i][0][1].raw for i in members]
            # Every output area is a view of one buffer (the ring, or a batch buffer without one):
            # nvCOMP's batches are carved from a single allocation at offsets.
            outputs = [live[i][2][1] for i in members]
            if slots and all(slot is not None for slot in slots):
                buffer = self._staging
                offsets = [out.data.ptr - buffer.data.ptr for out in outputs]
            else:
                offsets = [0]
                for size in raw_sizes[:-1]:
                    offsets.append(offsets[-1] + align_up(size))
                buffer = cupy.empty(offsets[-1] + align_up(raw_sizes[-1]), dtype=cupy.uint8)
            try:
                got = self._codec(user, data_type, delta).decode_into([live[i][1] for i in members], buffer,
                                                                      offsets, raw_sizes)
            except (ValueError, RuntimeError) as err:
                # nvCOMP raises RuntimeError for everything. Measured with nvCOMP 6.0:
                # Zstd short of scratch memory says "Could not determine the decompressed size",
                # a garbled Zstd / GDeflate / Snappy stream gives "an illegal memory access" and
                # leaves the CUDA context unusable. Neither proves the file damaged (its CRC
                # matched): only a ValueError (a stream claiming more bytes than its chunk) or a
                # status naming an undecodable stream does. Anything else reaches every future of
                # the batch as itself, so that a restore stops instead of skipping the file.
                if not isinstance(err, ValueError) and not reports_undecodable(err):
                    raise
                for i in members:
                    live[i][0][-1].set_exception(CorruptCheckpointError(f"chunk does not decode ({err})"))
                continue
            for i, offset, size in zip(members, offsets, got):
                raws[i] = buffer[offset:offset + size]
        delivered = []
        for (job, _body, (read_area, out_area)), raw in zip(live, raws):
            if raw is None:
                continue
            record, chain = job[1], job[2]
            if raw.nbytes != record.raw:
                job[-1].set_exception(CorruptCheckpointError(
                    f"chunk decoded to {raw.nbytes} bytes, expected {record.raw}"))
                continue
            for stage in reversed(chain[:-1]):
                if stage["name"] == XOR_BASE:
                    continue  # applied per array as the bytes are delivered (gdsckpt.state.delta)
                if stage["name"] != BYTE_PLANES.name:
                    raise UnsupportedFormatError(f"transform {stage['name']!r} is not known here")
                width = int(stage["width"])
                count = raw.nbytes // width
                # into whichever area does not hold the planes (a decoded stream is in the
                # output area; a stored ``none/1`` one is still in the read area)
                area = out_area if raw.data.ptr == read_area.data.ptr else read_area
                restored = area[:raw.nbytes]
                restored.reshape(count, width)[:, ::-1] = raw.reshape(width, count).T
                raw = restored
            job[4](raw)
            delivered.append(job[-1])
        return delivered

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout=self.timeout)
        if self._worker is None or not self._worker.is_alive():
            self._close_codecs()  # nvCOMP codecs go before the stream they run on
        else:  # a worker still running may be inside a codec: leave them to it
            self._codecs.clear()
        self._staging = None

