"""nvCOMP's C API through ctypes: the batched CRC-32C, and ANS decompression without a wait.

nvCOMP's Python package does not expose its CRC32 API, and its ``Codec.decode`` waits for the
stream before it returns (it hands back the decoded sizes as host numbers), at a cost per call
that does not shrink with the batch (docs/performance.md, "Fast tiers";
``experiments/batch_scaling.py`` measures it); a restore's worker spent that wait idle. This
module binds the C functions of ``libnvcomp`` (the library the Python package ships):

- ``nvcompBatchedCRC32Async`` with nvCOMP's CRC32-C preset (poly 0x1EDC6F41, init and xorout
  0xFFFFFFFF, reflected), exactly the checksum format v1 defines (``tests/gpu`` checks it against
  the CPU's ``crc32c``);
- ``nvcompBatchedANSDecompressAsync``, which queues a batch on a stream and leaves the statuses and
  decoded sizes in device memory (``AnsBatchDecoder``). ANS validates every stream it decodes (a
  damaged one ends with ``nvcompErrorCannotDecompress`` in its status) and the data type is read
  from the stream, so one call decodes every ANS chunk of a batch whatever its element type.

Imported only on machines with nvCOMP and CuPy.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Any

import cupy
import numpy as np


class _Spec(ctypes.Structure):
    _fields_ = [("poly", ctypes.c_uint32), ("init", ctypes.c_uint32), ("ref_in", ctypes.c_bool),
                ("ref_out", ctypes.c_bool), ("xorout", ctypes.c_uint32), ("reserved", ctypes.c_char * 16)]


class _KernelConf(ctypes.Structure):
    _fields_ = [("kernel_kind", ctypes.c_int), ("bytes_per_read", ctypes.c_int32),
                ("blocks_per_msg", ctypes.c_int32), ("reserved", ctypes.c_char * 20)]


class _CrcOpts(ctypes.Structure):
    _fields_ = [("spec", _Spec), ("kernel_conf", _KernelConf), ("reserved", ctypes.c_char * 64)]


class _AnsDecompressOpts(ctypes.Structure):
    """``nvcompBatchedANSDecompressOpts_t`` (nvcomp/ans.h): 64 bytes."""

    _fields_ = [("backend", ctypes.c_int), ("data_type", ctypes.c_int), ("max_sub_chunk_count", ctypes.c_uint8),
                ("states_per_lane", ctypes.c_uint8), ("skip_validate", ctypes.c_uint8),
                ("reserved", ctypes.c_char * 53)]


class _AnsCompressOpts(ctypes.Structure):
    """``nvcompBatchedANSCompressOpts_t`` (nvcomp/ans.h): 64 bytes."""

    _fields_ = [("type", ctypes.c_int), ("data_type", ctypes.c_int), ("max_sub_chunk_count", ctypes.c_uint8),
                ("states_per_lane", ctypes.c_uint8), ("histogram_reduction_log2", ctypes.c_uint8),
                ("reserved", ctypes.c_char * 53)]


class _Alignments(ctypes.Structure):
    """``nvcompAlignmentRequirements_t``."""

    _fields_ = [("input", ctypes.c_size_t), ("output", ctypes.c_size_t), ("temp", ctypes.c_size_t)]


_ONLY_SEGMENT = 0
_TYPE_FROM_STREAM = 0xFF
"""``NVCOMP_TYPE_BITS``: the ANS decoder reads the data type from each stream."""
_SUCCESS = 0
_DATA_TYPES = {None: 1, "|u1": 1, "|i1": 0, "<f2": 10, "<f4": 11}
"""ANS data types (the array-protocol strings of nvCOMP's Python API) -> ``nvcompType_t``; None:
bytes, as the Python API's default."""
_lock = threading.Lock()
_lib: Any = None


def _library() -> Any:
    """``libnvcomp`` with the signatures used here declared (loaded once)."""
    global _lib
    with _lock:
        if _lib is None:
            from nvidia import libnvcomp

            directory = os.path.join(os.path.dirname(libnvcomp.__file__), "lib64")
            names = sorted(n for n in os.listdir(directory) if n.startswith("libnvcomp.so"))
            # PyDLL: the calls keep the GIL. Each only queues work or computes a size (microseconds);
            # releasing the GIL around it, as CDLL does, lets the restore's other Python threads
            # take it, and the worker then waits for it once per call.
            lib = ctypes.PyDLL(os.path.join(directory, names[0]))
            pointer, size = ctypes.c_void_p, ctypes.c_size_t
            lib.nvcompBatchedCRC32Async.restype = ctypes.c_int
            lib.nvcompBatchedCRC32Async.argtypes = [pointer, pointer, size, pointer, _CrcOpts, ctypes.c_int,
                                                    pointer, pointer]
            lib.nvcompBatchedCRC32GetHeuristicConf.restype = ctypes.c_int
            lib.nvcompBatchedCRC32GetHeuristicConf.argtypes = [pointer, size, ctypes.POINTER(_KernelConf), size,
                                                               pointer]
            lib.nvcompBatchedANSCompressGetRequiredAlignments.restype = ctypes.c_int
            lib.nvcompBatchedANSCompressGetRequiredAlignments.argtypes = [_AnsCompressOpts,
                                                                          ctypes.POINTER(_Alignments)]
            lib.nvcompBatchedANSCompressGetMaxOutputChunkSize.restype = ctypes.c_int
            lib.nvcompBatchedANSCompressGetMaxOutputChunkSize.argtypes = [size, _AnsCompressOpts,
                                                                          ctypes.POINTER(size)]
            lib.nvcompBatchedANSCompressGetTempSize.restype = ctypes.c_int
            lib.nvcompBatchedANSCompressGetTempSize.argtypes = [size, size, _AnsCompressOpts, ctypes.POINTER(size),
                                                                size, pointer]
            lib.nvcompBatchedANSCompressAsync.restype = ctypes.c_int
            lib.nvcompBatchedANSCompressAsync.argtypes = [pointer, pointer, size, size, pointer, size, pointer,
                                                          pointer, _AnsCompressOpts, pointer, pointer]
            lib.nvcompBatchedANSDecompressGetRequiredAlignments.restype = ctypes.c_int
            lib.nvcompBatchedANSDecompressGetRequiredAlignments.argtypes = [_AnsDecompressOpts,
                                                                            ctypes.POINTER(_Alignments)]
            lib.nvcompBatchedANSDecompressGetTempSize.restype = ctypes.c_int
            lib.nvcompBatchedANSDecompressGetTempSize.argtypes = [size, size, _AnsDecompressOpts,
                                                                  ctypes.POINTER(size), size, pointer]
            lib.nvcompBatchedANSDecompressAsync.restype = ctypes.c_int
            lib.nvcompBatchedANSDecompressAsync.argtypes = [pointer, pointer, pointer, pointer, size, pointer, size,
                                                            pointer, _AnsDecompressOpts, pointer, pointer]
            _lib = lib
    return _lib


def _check(status: int, what: str) -> None:
    """A launch that nvCOMP refused is a programming or device error, never damage."""
    if status != _SUCCESS:
        raise RuntimeError(f"{what} failed with nvCOMP status {status}")


def _aligned(inputs: list[Any], base: int, offsets: list[int], input_alignment: int, output_alignment: int) -> bool:
    """Whether every input and every output (``base`` + offset) meets nvCOMP's alignment."""
    return (all(int(data.data.ptr) % input_alignment == 0 for data in inputs)
            and all((base + int(offset)) % output_alignment == 0 for offset in offsets))


def _at_least(buffer: Any, nbytes: int, device_id: int) -> Any:
    """``buffer`` when it holds ``nbytes`` (or none are needed), else a new device buffer of
    ``nbytes``: the temporary memory of a batch, kept and grown across batches."""
    if nbytes == 0 or (buffer is not None and buffer.nbytes >= nbytes):
        return buffer
    with cupy.cuda.Device(device_id):
        return cupy.empty(nbytes, dtype=cupy.uint8)


def _waited(results: Any, count: int, stream: Any) -> tuple[list[int], list[int]]:
    """(sizes, failed statuses) of a batch whose ``results`` hold ``count`` uint64 sizes followed
    by ``count`` int32 statuses, once ``stream`` has finished."""
    host = results.get(stream=stream)
    stream.synchronize()
    statuses = host[count:].view(np.int32)[:count]
    return [int(size) for size in host[:count]], [int(status) for status in statuses if status != _SUCCESS]


def crc32c_launch(pointers: int, sizes: int, count: int, largest: int, out: int, stream: Any) -> None:
    """Queue the CRC-32C of ``count`` device buffers on ``stream``: ``pointers`` and ``sizes`` are
    device arrays of ``count`` uint64 (addresses, lengths), ``out`` a device array of ``count``
    uint32 that receives the checksums; ``largest`` is the longest length."""
    lib = _library()
    opts = _CrcOpts()
    opts.spec = _Spec(0x1EDC6F41, 0xFFFFFFFF, True, True, 0xFFFFFFFF, b"")
    conf = _KernelConf()
    _check(lib.nvcompBatchedCRC32GetHeuristicConf(None, count, ctypes.byref(conf), max(1, largest),
                                                  ctypes.c_void_p(stream.ptr)), "nvcompBatchedCRC32GetHeuristicConf")
    opts.kernel_conf = conf
    _check(lib.nvcompBatchedCRC32Async(pointers, sizes, count, out, opts, _ONLY_SEGMENT, None,
                                       ctypes.c_void_p(stream.ptr)), "nvcompBatchedCRC32Async")


def crc32c_batch(buffers: list[Any], stream: Any) -> np.ndarray:
    """CRC-32C of each CuPy uint8 array in ``buffers``, computed on ``stream``; returns a host
    uint32 array (this synchronizes ``stream``)."""
    count = len(buffers)
    if count == 0:
        return np.zeros(0, dtype=np.uint32)
    table = np.array([[b.data.ptr for b in buffers], [b.nbytes for b in buffers]], dtype=np.uint64)
    with cupy.cuda.Device(buffers[0].device.id):
        on_device = cupy.asarray(table)
        out = cupy.zeros(count, dtype=np.uint32)
        crc32c_launch(on_device[0].data.ptr, on_device[1].data.ptr, count, int(table[1].max()), out.data.ptr,
                      stream)
        host: np.ndarray = out.get(stream=stream)
        stream.synchronize()
    return host


class AnsBatchDecoder:
    """Queues batches of nvCOMP ANS streams for decompression on one stream, without waiting.

    ``decode(pointers, sizes, capacities, outputs, count, largest)`` takes device arrays (uint64
    addresses and lengths of the streams, room of each output, output addresses) and device
    arrays it fills: ``statuses`` (int32, 0 where a stream decoded) and ``decoded`` (uint64
    sizes). Its temporary memory is allocated once and grown when a batch needs more; it is freed
    with the decoder."""

    def __init__(self, stream: Any, device_id: int):
        self.stream = stream
        self.device_id = device_id
        self._lib = _library()
        self._opts = _AnsDecompressOpts()
        self._opts.data_type = _TYPE_FROM_STREAM
        alignments = _Alignments()
        _check(self._lib.nvcompBatchedANSDecompressGetRequiredAlignments(self._opts, ctypes.byref(alignments)),
               "nvcompBatchedANSDecompressGetRequiredAlignments")
        self.input_alignment = max(1, int(alignments.input))
        self.output_alignment = max(1, int(alignments.output))
        self._temp: Any = None

    def temp_bytes(self, count: int, largest: int) -> int:
        """nvCOMP's temporary bytes for a batch of ``count`` outputs of at most ``largest`` bytes."""
        temp = ctypes.c_size_t(0)
        _check(self._lib.nvcompBatchedANSDecompressGetTempSize(count, largest, self._opts, ctypes.byref(temp),
                                                               count * largest, ctypes.c_void_p(self.stream.ptr)),
               "nvcompBatchedANSDecompressGetTempSize")
        return int(temp.value)

    def decode(self, pointers: int, sizes: int, capacities: int, outputs: int, count: int, largest: int, *,
               statuses: int, decoded: int) -> None:
        """Queue the batch (see the class docstring); nothing is waited for."""
        need = self.temp_bytes(count, largest)
        self._temp = _at_least(self._temp, need, self.device_id)
        temp = self._temp.data.ptr if need else None
        _check(self._lib.nvcompBatchedANSDecompressAsync(pointers, sizes, capacities, decoded, count, temp, need,
                                                         outputs, self._opts, statuses,
                                                         ctypes.c_void_p(self.stream.ptr)),
               "nvcompBatchedANSDecompressAsync")

    def close(self) -> None:
        """Release the temporary memory (after the work queued on the stream)."""
        self._temp = None


class AnsCodec:
    """nvCOMP ANS through the C API, with the interface of ``nvcomp.DeviceCodec`` (the GPU
    encoder and the decoder's synchronous path use it as they use any device codec): one table
    upload, one launch and one wait per batch, a fraction of the Python API's ``Codec`` call
    (docs/performance.md). Writes the RAW bitstream nvCOMP's Python API writes for the same
    ``data_type`` (``tests/gpu`` compares the two); ``nvcomp.ans/1``."""

    user_name = "ans"
    delta = None

    def __init__(self, *, stream: Any, device_id: int, data_type: str | None = None):
        if data_type not in _DATA_TYPES:
            raise ValueError(f"ANS data type {data_type!r} is not one of {sorted(map(str, _DATA_TYPES))}")
        self.stream = stream
        self.device_id = device_id
        self.data_type = data_type
        self._lib = _library()
        self._opts = _AnsCompressOpts()
        self._opts.data_type = _DATA_TYPES[data_type]
        alignments = _Alignments()
        _check(self._lib.nvcompBatchedANSCompressGetRequiredAlignments(self._opts, ctypes.byref(alignments)),
               "nvcompBatchedANSCompressGetRequiredAlignments")
        self._alignments = (max(1, int(alignments.input)), max(1, int(alignments.output)))
        self.decoder = AnsBatchDecoder(stream, device_id)
        """This codec's queued decoder (also what ``CudaDevice.verified_ans_decode`` runs)."""
        self._temp: Any = None
        self._fallback: Any = None
        """The Python API's codec, for inputs the C API's alignment rule refuses (made when needed)."""

    def stage(self) -> dict[str, Any]:
        """``{"name": "nvcomp.ans/1"}`` plus the data type, as ``nvcomp.codec_stage`` writes it."""
        from .nvcomp import codec_stage

        return codec_stage("ans", self.data_type)

    def max_compressed_bytes(self, probe: Any) -> int:
        """nvCOMP's bound on the stream of one input the size of ``probe``."""
        bound = ctypes.c_size_t(0)
        _check(self._lib.nvcompBatchedANSCompressGetMaxOutputChunkSize(int(probe.nbytes), self._opts,
                                                                       ctypes.byref(bound)),
               "nvcompBatchedANSCompressGetMaxOutputChunkSize")
        return int(bound.value)

    def _python_codec(self) -> Any:
        if self._fallback is None:
            from .nvcomp import DeviceCodec

            self._fallback = DeviceCodec("ans", stream=self.stream, device_id=self.device_id, data_type=self.data_type)
        return self._fallback

    def encode_into(self, inputs: list[Any], buffer: Any, offsets: list[int], capacity: int) -> list[int]:
        """Compress CuPy uint8 arrays into ``buffer`` at ``offsets`` (``capacity`` bytes each);
        returns the stream sizes (waits for the stream once)."""
        count = len(inputs)
        if count == 0:
            return []
        base = int(buffer.data.ptr)
        if not _aligned(inputs, base, offsets, *self._alignments):
            return self._python_codec().encode_into(inputs, buffer, offsets, capacity)  # type: ignore[no-any-return]
        if any(int(o) + capacity > buffer.nbytes for o in offsets):
            raise ValueError("an ANS output runs past its buffer")
        sizes_in = [int(data.nbytes) for data in inputs]
        table = np.array([[int(data.data.ptr) for data in inputs], sizes_in, [base + int(o) for o in offsets]],
                         dtype=np.uint64)
        largest = max(sizes_in)
        with cupy.cuda.Device(self.device_id):
            on_device = cupy.asarray(table)
            results = cupy.zeros(2 * count, dtype=cupy.uint64)  # sizes, then the int32 statuses
            temp_bytes = ctypes.c_size_t(0)
            _check(self._lib.nvcompBatchedANSCompressGetTempSize(count, largest, self._opts, ctypes.byref(temp_bytes),
                                                                 sum(sizes_in), ctypes.c_void_p(self.stream.ptr)),
                   "nvcompBatchedANSCompressGetTempSize")
            need = int(temp_bytes.value)
            self._temp = _at_least(self._temp, need, self.device_id)
            first = on_device.data.ptr
            _check(self._lib.nvcompBatchedANSCompressAsync(
                first, first + 8 * count, largest, count, self._temp.data.ptr if need else None, need,
                first + 16 * count, results.data.ptr, self._opts, results.data.ptr + 8 * count,
                ctypes.c_void_p(self.stream.ptr)), "nvcompBatchedANSCompressAsync")
            sizes, failed = _waited(results, count, self.stream)
        if failed:
            raise RuntimeError(f"nvCOMP ANS compression failed with status {failed[0]}")
        if max(sizes) > capacity:
            raise RuntimeError(f"nvCOMP ANS wrote a stream of {max(sizes)} bytes into room for {capacity}")
        return sizes

    def decode_into(self, inputs: list[Any], buffer: Any, offsets: list[int], sizes: list[int]) -> list[int]:
        """Decompress streams into ``buffer`` at ``offsets`` (room for ``sizes`` bytes each); the
        decoded sizes (waits for the stream). A stream nvCOMP cannot decode raises a
        ``RuntimeError`` naming ``nvcompErrorCannotDecompress`` (what ``nvcomp.reports_undecodable``
        recognises), as the Python API does."""
        count = len(inputs)
        if count == 0:
            return []
        base = int(buffer.data.ptr)
        if not _aligned(inputs, base, offsets, self.decoder.input_alignment, self.decoder.output_alignment):
            return self._python_codec().decode_into(inputs, buffer, offsets, sizes)  # type: ignore[no-any-return]
        table = np.array([[int(data.data.ptr) for data in inputs], [int(data.nbytes) for data in inputs],
                          [int(size) for size in sizes], [base + int(o) for o in offsets]], dtype=np.uint64)
        with cupy.cuda.Device(self.device_id):
            on_device = cupy.asarray(table)
            results = cupy.zeros(2 * count, dtype=cupy.uint64)  # decoded sizes, then statuses
            first = on_device.data.ptr
            self.decoder.decode(first, first + 8 * count, first + 16 * count, first + 24 * count, count,
                                 max(int(size) for size in sizes), statuses=results.data.ptr + 8 * count,
                                 decoded=results.data.ptr)
            decoded, failed = _waited(results, count, self.stream)
        if failed:
            raise RuntimeError(f"nvcompErrorCannotDecompress: ANS status {failed[0]} for "
                               f"{len(failed)} of {count} streams")
        return decoded

    def close(self) -> None:
        """Release the temporary memory after the work queued on the stream."""
        with contextlib.suppress(Exception):  # a failed device: its error is raised elsewhere
            self.stream.synchronize()
        self._temp = None
        self.decoder.close()
        if self._fallback is not None:
            self._fallback.close()
            self._fallback = None
