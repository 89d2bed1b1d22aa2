"""GPU codecs through nvCOMP's Python API (``nvidia.nvcomp``), RAW bitstreams, batched.

Bitstream names: nvCOMP's Zstd, LZ4 and Deflate RAW streams are the standard zstd frames, raw
LZ4 blocks and raw deflate streams, so they are written under the portable names ``zstd/1``,
``lz4/1`` and ``deflate/1`` and a checkpoint written on the GPU loads without one. ANS, GDeflate,
Snappy, Bitcomp and Cascaded streams are written as ``nvcomp.<name>/1`` and need a GPU to decode.
ANS takes a ``data_type`` (``"<f2"`` for bf16/fp16, ``"<f4"``, ``"|u1"``), recorded in its stage.

Bitcomp's lossy floating-point mode has a name of its own, ``nvcomp.bitcomp-lossy/1``, with its
``data_type`` and ``delta`` in the stage: its streams decode to the right values only with a
decoder given the encoder's mode and delta (a lossless Bitcomp decoder returns other bytes
without an error, run 15), so a reader that knows only ``nvcomp.bitcomp/1`` must fail on them
instead of decoding them. No user selects it as a codec: the GPU engine writes it for arrays that
``save(lossy=...)`` rounded to a grid (``gdsckpt.lossy``).

nvCOMP, CuPy and the driver are imported lazily: importing this module on a machine without them
raises ImportError, which ``gpu_available()`` turns into False.
"""

from __future__ import annotations

from typing import Any

GPU_ALGORITHMS = {
    "ans": ("ANS", "nvcomp.ans/1"),
    "zstd": ("Zstd", "zstd/1"),
    "lz4": ("LZ4", "lz4/1"),
    "deflate": ("Deflate", "deflate/1"),
    "gdeflate": ("GDeflate", "nvcomp.gdeflate/1"),
    "snappy": ("Snappy", "nvcomp.snappy/1"),
    "bitcomp": ("Bitcomp", "nvcomp.bitcomp/1"),
    "cascaded": ("Cascaded", "nvcomp.cascaded/1"),
}
"""User-facing name -> (nvCOMP algorithm, versioned bitstream name)."""
BY_VERSIONED = {versioned: (user, algorithm) for user, (algorithm, versioned) in GPU_ALGORITHMS.items()}
BITCOMP_LOSSY = "nvcomp.bitcomp-lossy/1"
"""Bitstream name of Bitcomp's lossy floating-point mode (``BITCOMP_LOSSY_FP_TO_SIGNED``)."""
BITCOMP_LOSSY_TYPES = {"float32": "<f4", "float16": "<f2"}
"""Dtypes Bitcomp's lossy mode codes (nvCOMP 6.0 has no bfloat16 there) -> nvCOMP data type."""
MAX_CHUNK_BYTES = 16 << 20
"""The largest chunk every nvCOMP RAW algorithm accepts."""


def gpu_available() -> bool:
    """True when CuPy, nvCOMP and at least one CUDA device are usable here."""
    try:
        import cupy
        from nvidia import nvcomp  # noqa: F401

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # no package, no driver, no device: all mean "no GPU path here"
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
    return data_type, float(delta)


_UNCLOSED: list[tuple[Any, Any]] = []
"""nvCOMP codecs (with their streams) whose wrapper was collected without ``close``: kept, never
destroyed by the garbage collector (see ``DeviceCodec.__del__``)."""


class DeviceCodec:
    """One nvCOMP codec bound to a CUDA stream and device. Not thread-safe (nvCOMP's rule: one
    Codec per thread); the GPU engine uses it from its worker thread only.

    ``delta`` (with ``user_name="bitcomp"`` and a ``data_type`` of ``BITCOMP_LOSSY_TYPES``) makes
    it Bitcomp's lossy floating-point mode, writing ``nvcomp.bitcomp-lossy/1``: each value becomes
    an integer multiple of ``delta`` rounded down to a power of two, error at most half of it
    (values already on that grid come back as the same values, zeros as +0.0)."""

    def __init__(self, user_name: str, *, stream: Any, device_id: int, data_type: str | None = None,
                 delta: float | None = None):
        from nvidia import nvcomp

        self.user_name = user_name
        algorithm, self.versioned = GPU_ALGORITHMS[user_name]
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
            try:
                self.stream.synchronize()
            except Exception:  # noqa: BLE001 - a failed device: the error that failed it is raised elsewhere
                pass
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
        """The JSON stage naming this bitstream in a chain."""
        stage: dict[str, Any] = {"name": self.versioned}
        if (self.user_name == "ans" or self.delta is not None) and self.data_type is not None:
            stage["data_type"] = self.data_type
        if self.delta is not None:
            stage["delta"] = self.delta
        return stage

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
