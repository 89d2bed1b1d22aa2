"""CRC-32C of device buffers, computed on the GPU by nvCOMP's batched CRC32 (``crc32.h``).

nvCOMP's Python package does not expose its CRC32 API, so this binds the C function
``nvcompBatchedCRC32Async`` from ``libnvcomp`` with ctypes, configured with nvCOMP's CRC32-C
preset (poly 0x1EDC6F41, init and xorout 0xFFFFFFFF, reflected), which is exactly the checksum
format v1 defines; ``tests/gpu`` checks equality with the CPU's ``crc32c`` on random buffers.
Imported only on machines with nvCOMP and CuPy.
"""

from __future__ import annotations

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


class _Opts(ctypes.Structure):
    _fields_ = [("spec", _Spec), ("kernel_conf", _KernelConf), ("reserved", ctypes.c_char * 64)]


_ONLY_SEGMENT = 0
_lock = threading.Lock()
_lib: Any = None


def _library() -> Any:
    global _lib
    with _lock:
        if _lib is None:
            from nvidia import libnvcomp

            directory = os.path.join(os.path.dirname(libnvcomp.__file__), "lib64")
            names = sorted(n for n in os.listdir(directory) if n.startswith("libnvcomp.so"))
            lib = ctypes.CDLL(os.path.join(directory, names[0]))
            lib.nvcompBatchedCRC32Async.restype = ctypes.c_int
            lib.nvcompBatchedCRC32Async.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                    ctypes.c_void_p, _Opts, ctypes.c_int, ctypes.c_void_p,
                                                    ctypes.c_void_p]
            lib.nvcompBatchedCRC32GetHeuristicConf.restype = ctypes.c_int
            lib.nvcompBatchedCRC32GetHeuristicConf.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                                               ctypes.POINTER(_KernelConf), ctypes.c_size_t,
                                                               ctypes.c_void_p]
            _lib = lib
    return _lib


def crc32c_batch(buffers: list[Any], stream: Any) -> np.ndarray:
    """CRC-32C of each CuPy uint8 array in ``buffers``, computed on ``stream``; returns a host
    uint32 array (this synchronizes ``stream``)."""
    lib = _library()
    count = len(buffers)
    if count == 0:
        return np.zeros(0, dtype=np.uint32)
    pointers = cupy.asarray(np.array([b.data.ptr for b in buffers], dtype=np.uint64))
    sizes_host = np.array([b.nbytes for b in buffers], dtype=np.uint64)
    sizes = cupy.asarray(sizes_host)
    out = cupy.zeros(count, dtype=np.uint32)
    opts = _Opts()
    opts.spec = _Spec(0x1EDC6F41, 0xFFFFFFFF, True, True, 0xFFFFFFFF, b"")
    conf = _KernelConf()
    status = lib.nvcompBatchedCRC32GetHeuristicConf(None, count, ctypes.byref(conf),
                                                    int(max(1, sizes_host.max())), ctypes.c_void_p(stream.ptr))
    if status != 0:
        raise RuntimeError(f"nvcompBatchedCRC32GetHeuristicConf failed with status {status}")
    opts.kernel_conf = conf
    status = lib.nvcompBatchedCRC32Async(pointers.data.ptr, sizes.data.ptr, count, out.data.ptr, opts,
                                         _ONLY_SEGMENT, None, ctypes.c_void_p(stream.ptr))
    if status != 0:
        raise RuntimeError(f"nvcompBatchedCRC32Async failed with status {status}")
    host: np.ndarray = out.get(stream=stream)
    stream.synchronize()
    return host
