"""GPU codecs through nvCOMP's Python API (``nvidia.nvcomp``), RAW bitstreams, batched.

(ANS, the default, runs through nvCOMP's C API instead: ``nvcomp_c.AnsCodec``, the same
bitstream for a fraction of the per-call cost; ``device.CudaDevice.codec`` picks it.)

Bitstream names: nvCOMP's Zstd, LZ4 and Deflate RAW streams are the standard zstd frames, raw
LZ4 blocks and raw deflate streams, so they are written under the portable names ``zstd/1``,
``lz4/1`` and ``deflate/1`` and a checkpoint written on the GPU loads without one. ANS, GDeflate,
Snappy, Bitcomp and Cascaded streams are written as ``nvcomp.<name>/1`` and need a GPU to decode.
ANS takes a ``data_type`` (``"<f2"`` for bf16/fp16, ``"<f4"``, ``"|u1"``), recorded in its stage.

Bitcomp's lossy floating-point mode has a name of its own, ``nvcomp.bitcomp-lossy/1``, with its
``data_type`` and ``delta`` in the stage: its streams decode to the right values only with a
decoder given the encoder's mode and delta (a lossless Bitcomp decoder returns other bytes
without an error), so a reader that knows only ``nvcomp.bitcomp/1`` must fail on them
instead of decoding them. No user selects it as a codec: the GPU encoder writes it for arrays that
``save(lossy=...)`` rounded to a grid (``gdsckpt.state.lossy``).

nvCOMP, CuPy and the driver are imported lazily: importing this module on a machine without them
raises ImportError, which ``gpu_available()`` turns into False.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import threading
from typing import Any

from ..errors import NewerFormatError
from .base import codec_spec, gpu_codec_by_versioned

BITCOMP_LOSSY = "nvcomp.bitcomp-lossy/1"
"""Bitstream name of Bitcomp's lossy floating-point mode (``BITCOMP_LOSSY_FP_TO_SIGNED``)."""
BITCOMP_LOSSY_TYPES = {"float32": "<f4", "float16": "<f2"}
"""Dtypes Bitcomp's lossy mode codes (nvCOMP 6.0 has no bfloat16 there) -> nvCOMP data type."""
MAX_CHUNK_BYTES = 16 << 20
"""The largest chunk every nvCOMP RAW algorithm accepts (ANS, LZ4, Snappy, Bitcomp, Cascaded:
16 MiB), hence the largest ``Config.gpu_chunk_bytes``."""
NVCOMP_UNDECODABLE = re.compile(r"nvcompErrorCannotDecompress|nvcompErrorBadChecksum|cannot decompress",
                                re.IGNORECASE)
"""How nvCOMP's Python API names the statuses that prove a stream undecodable
(``nvcompErrorCannotDecompress``, 12: corrupt or truncated input; ``nvcompErrorBadChecksum``, 13).
None of the errors measured with nvCOMP 6.0 named one (a garbled Zstd stream reports "an illegal
memory access", a decode short of scratch "Could not determine the decompressed size"); an error
that does not name one is not taken for damage."""


def reports_undecodable(err: BaseException) -> bool:
    """Whether an nvCOMP error reports a stream it cannot decode (proof of damage), as opposed to
    running out of memory, a CUDA or device fault, or anything else it raises ``RuntimeError`` for."""
    return bool(NVCOMP_UNDECODABLE.search(str(err)))


DecoderKey = tuple[str, "str | None", "float | None"]
"""(versioned bitstream name, nvCOMP data type, Bitcomp lossy delta): what picks a device decoder."""


def decoder_key(stage: dict[str, Any]) -> DecoderKey:
    """(bitstream name, data type, delta) that picks the decoder of a chain's codec stage, its
    parameters checked (``ValueError``): they come from the file and key a dict. Whether the
    bitstream has a device decoder is ``device_decoder_name``'s question."""
    name = stage["name"]
    if name == BITCOMP_LOSSY:
        return (name, *bitcomp_lossy_params(stage))
    data_type = stage.get("data_type")
    if data_type is not None and not isinstance(data_type, str):
        raise ValueError(f"{name} stage has data_type {data_type!r}, expected a string")
    return name, data_type, None


def device_decoder_name(versioned: str) -> str:
    """The user-facing name of the nvCOMP codec that decodes bitstream ``versioned``
    (``"bitcomp"`` for ``nvcomp.bitcomp-lossy/1``); ``UnsupportedFormatError`` when no nvCOMP
    codec of this version decodes it."""
    if versioned == BITCOMP_LOSSY:
        return "bitcomp"
    spec = gpu_codec_by_versioned(versioned)
    if spec is None or spec.user_name is None:
        raise NewerFormatError(f"codec {versioned!r} is not known to this version of gdsckpt; upgrade gdsckpt")
    return spec.user_name


def gpu_available() -> bool:
    """True when CuPy, nvCOMP and at least one CUDA device are usable here."""
    try:
        import cupy
        from nvidia import nvcomp  # noqa: F401

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # noqa: BLE001 - no package, no driver, no device: all mean "no GPU path here"
        return False


def bitcomp_lossy_params(stage: dict[str, Any]) -> tuple[str, float]:
    """(data_type, delta) of a ``nvcomp.bitcomp-lossy/1`` stage read from an index, checked:
    ``ValueError`` unless ``data_type`` is ``"<f4"`` or ``"<f2"`` and ``delta`` a finite positive
    number (the reader reports it as a corrupt chunk)."""
    data_type, delta = stage.get("data_type"), stage.get("delta")
    if data_type not in BITCOMP_LOSSY_TYPES.values():
        raise ValueError(f"{BITCOMP_LOSSY} stage has data_type {data_type!r}, expected one of "
                         f"{sorted(BITCOMP_LOSSY_TYPES.values())}")
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < float("inf"):
        raise ValueError(f"{BITCOMP_LOSSY} stage has delta {delta!r}, expected a finite positive number")
    return str(data_type), float(delta)


def codec_stage(user_name: str, data_type: str | None = None, delta: float | None = None) -> dict[str, Any]:
    """The JSON stage naming the bitstream of the device codec (``user_name``, ``data_type``,
    Bitcomp lossy ``delta``) in a chain: ANS and Bitcomp lossy record their data type (their
    decoders need it), Bitcomp lossy its delta; the others decode without parameters."""
    stage: dict[str, Any] = {"name": BITCOMP_LOSSY if delta is not None else codec_spec(user_name).versioned}
    if (user_name == "ans" or delta is not None) and data_type is not None:
        stage["data_type"] = data_type
    if delta is not None:
        stage["delta"] = delta
    return stage


_UNCLOSED: list[tuple[Any, Any]] = []
"""nvCOMP codecs (with their streams) whose wrapper was collected without ``close``: kept, never
destroyed by the garbage collector (see ``DeviceCodec.__del__``)."""


class DeviceCodec:
    """One nvCOMP codec bound to a CUDA stream and device. Not thread-safe (nvCOMP's rule: one
    Codec per thread); the GPU encoder and decoder use it from their worker thread only.

    ``delta`` (with ``user_name="bitcomp"`` and a ``data_type`` of ``BITCOMP_LOSSY_TYPES``) makes
    it Bitcomp's lossy floating-point mode, writing ``nvcomp.bitcomp-lossy/1``: each value becomes
    an integer multiple of ``delta`` rounded down to a power of two, error at most half of it
    (values already on that grid come back as the same values, zeros as +0.0)."""

    def __init__(self, user_name: str, *, stream: Any, device_id: int, data_type: str | None = None,
                 delta: float | None = None):
        from nvidia import nvcomp

        spec = codec_spec(user_name)
        if spec.nvcomp_algorithm is None or spec.user_name is None:
            raise ValueError(f"codec {user_name!r} has no nvCOMP implementation")
        self.user_name = user_name
        algorithm, self.versioned = spec.nvcomp_algorithm, spec.versioned
        self.data_type = data_type
        self.delta = delta
        self.stream = stream
        options: dict[str, Any] = {"algorithm": algorithm, "bitstream_kind": nvcomp.BitstreamKind.RAW,
                                   "cuda_stream": stream.ptr, "device_id": device_id}
        if data_type is not None:
            options["data_type"] = data_type
        if delta is not None:
            if user_name != "bitcomp" or data_type not in BITCOMP_LOSSY_TYPES.values():
                raise ValueError(f"Bitcomp's lossy mode takes data_type <f4 or <f2, got {user_name!r}, "
                                 f"{data_type!r}")
            options["mode"] = nvcomp.BitcompMode.BITCOMP_LOSSY_FP_TO_SIGNED
            options["delta"] = float(delta)
            self.versioned = BITCOMP_LOSSY
        self._nvcomp = nvcomp
        self._codec = nvcomp.Codec(**options)

    def close(self) -> None:
        """Destroy the nvCOMP codec now, after the work queued on its stream. Its owner calls this
        when done: the wrapper may outlive that moment (a traceback kept with a failed future holds
        it in a reference cycle), and a codec left to the garbage collector is destroyed on
        whichever thread the collection happens to run, in the middle of another engine's work."""
        codec = self.__dict__.pop("_codec", None)
        if codec is not None:
            # a failed device: the error that failed it is raised elsewhere
            with contextlib.suppress(Exception):
                self.stream.synchronize()
            del codec

    def __del__(self) -> None:
        # Reached with the nvCOMP codec still open only when the owner never called ``close``
        # and, in practice, when the wrapper sat in a reference cycle: the collector then runs
        # this on whatever thread triggered it, and destroying the codec there crashed the
        # process (SIGSEGV in a GPU worker thread, seen in the GPU test suite). Keeping such a
        # codec for the life of the process costs its small host and device state; every engine
        # closes its codecs, so only a caller that forgot ``close`` pays it.
        codec = self.__dict__.pop("_codec", None)
        if codec is not None:
            _UNCLOSED.append((codec, self.stream))

    def stage(self) -> dict[str, Any]:
        """The JSON stage naming this bitstream in a chain (``codec_stage``)."""
        return codec_stage(self.user_name, self.data_type, self.delta)

    def max_compressed_bytes(self, probe: Any) -> int:
        """nvCOMP's bound on the stream size of one input the size of ``probe`` (a CuPy array)."""
        return int(self._codec.get_max_comp_buffer_size(self._nvcomp.as_array(probe)))

    def encode_into(self, inputs: list[Any], buffer: Any, offsets: list[int], capacity: int) -> list[int]:
        """Compress CuPy uint8 arrays into ``buffer`` (a CuPy uint8 array) at ``offsets``, each with
        room for ``capacity`` bytes; returns the stream sizes. nvCOMP's Python batches cannot be
        indexed, so outputs always go to memory we own (the staging ring)."""
        batch = self._nvcomp.as_arrays(inputs, cuda_stream=self.stream.ptr)
        out = self._nvcomp.as_arrays(buffer, list(offsets), [capacity] * len(offsets))
        result = self._codec.encode(batch, out=out)
        return [int(size) for size in result.buffer_sizes]

    def decode_into(self, inputs: list[Any], buffer: Any, offsets: list[int], sizes: list[int]) -> list[int]:
        """Decompress streams into ``buffer`` at ``offsets`` (room for ``sizes`` bytes each);
        returns the decoded sizes."""
        batch = self._nvcomp.as_arrays(inputs, cuda_stream=self.stream.ptr)
        out = self._nvcomp.as_arrays(buffer, list(offsets), list(sizes))
        result = self._codec.decode(batch, out=out)
        return [int(size) for size in result.buffer_sizes]


_allocator_installed = False
_allocator_lock = threading.Lock()


def install_nvcomp_allocator() -> None:
    """Route nvCOMP's own device allocations (scratch, temporaries) to CuPy's memory pool.

    Without it nvCOMP calls cudaMalloc/cudaFree around each batch, which costs time and keeps its
    memory outside any bound we can see; with it the memory is pooled, reused across batches,
    and counted by ``cupy.get_default_memory_pool()``. Process-wide, installed once.

    Opt-in (``GDSCKPT_NVCOMP_ALLOCATOR=1``): with nvCOMP 6.0.0 and CuPy 14.2 every process that
    used it passed its work and then crashed with SIGSEGV at interpreter exit (nvCOMP's global
    allocator outlives the Python callable it holds). Resetting it with
    ``set_device_allocator(None)`` before exit avoided the crash in a probe, so an exit hook does
    that here; off by default until the whole GPU suite has run with it.
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


def nvcomp_allocator_installed() -> bool:
    """Whether ``install_nvcomp_allocator`` routed nvCOMP's allocations to CuPy's pool."""
    return _allocator_installed
