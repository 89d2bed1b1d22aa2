"""A GPU-less stand-in for ``gdsckpt.codecs.device.CudaDevice``: NumPy arrays as "device" arrays
and CPU implementations of the device codec calls, with the same batch interface.

FOR TESTS ONLY. Nothing in the ``gdsckpt`` package imports or selects it; tests pass it as
``device=`` to ``GpuEncoder`` / ``GpuDecoder`` so the encoder's and decoder's own logic (staging
ring, batching, byte-plane decisions, fallbacks, error handling) runs in CPU CI.

Bitstreams: the portable codecs (``zstd``, ``lz4``, ``deflate``) write the real bitstreams with the
CPU libraries (which nvCOMP's RAW streams equal), so files written through the fake are readable by
the CPU engine and vice versa. The GPU-only codecs (ANS, Bitcomp, ...) are FAKE: a ``FAKE-NVCOMP``
marker plus a zstd frame, readable only by this fake; Bitcomp's "lossy" mode is lossless here
unless ``garble_lossy`` makes its decode return other values. Faults can be injected per call
(``fail``), and every call is recorded (``calls``) so tests can check batching.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import zstandard

from gdsckpt.codecs import codec_spec, host_codec
from gdsckpt.codecs.device import CheckedBatch, planes_inverse_into
from gdsckpt.codecs.nvcomp import BITCOMP_LOSSY_TYPES, codec_stage
from gdsckpt.format import checksum
from gdsckpt.pipeline.gpu.staging import decode_scratch, encode_scratch

FAKE_MARKER = b"FAKE-NVCOMP"
"""Prefix of every stream a fake GPU-only codec writes: such a file can never pass for a real one."""
GARBAGE = 0xA5
"""What new fake device memory holds: reading bytes nobody wrote shows up as this pattern."""


class FakeCodec:
    """The fake's ``DeviceCodecLike``: batches in, batches out, through a CPU codec."""

    def __init__(self, device: FakeDevice, user_name: str, data_type: str | None, delta: float | None):
        spec = codec_spec(user_name)
        if spec.nvcomp_algorithm is None:
            raise ValueError(f"codec {user_name!r} has no nvCOMP implementation")
        if delta is not None and (user_name != "bitcomp" or data_type not in BITCOMP_LOSSY_TYPES.values()):
            raise ValueError(f"Bitcomp's lossy mode takes data_type <f4 or <f2, got {user_name!r}, {data_type!r}")
        self.device, self.user_name, self.data_type, self.delta = device, user_name, data_type, delta
        self.portable = spec.cpu_readable
        self.closed = False

    def stage(self) -> dict[str, Any]:
        """The same stage the real ``DeviceCodec`` writes."""
        return codec_stage(self.user_name, self.data_type, self.delta)

    def max_compressed_bytes(self, probe: Any) -> int:
        """A generous bound: the input, zstd's and LZ4's worst-case growth, and the marker."""
        n = int(probe.nbytes)
        return n + n // 128 + 1024

    def _compress(self, data: np.ndarray) -> bytes:
        if self.portable:
            return bytes(memoryview(host_codec(self.user_name).encode(np.ascontiguousarray(data))).cast("B"))
        return FAKE_MARKER + zstandard.ZstdCompressor(level=1, write_content_size=True).compress(data.tobytes())

    def _decompress(self, data: np.ndarray, size: int) -> bytes:
        if self.portable:
            return bytes(memoryview(host_codec(self.user_name).decode(data.tobytes(), size)).cast("B"))
        body = data.tobytes()
        if not body.startswith(FAKE_MARKER):
            raise RuntimeError("nvcompErrorCannotDecompress: not a fake stream")
        try:
            return zstandard.ZstdDecompressor().decompress(body[len(FAKE_MARKER):], max_output_size=max(size, 1))
        except zstandard.ZstdError as err:
            raise RuntimeError(f"nvcompErrorCannotDecompress: {err}") from err

    def _scratch(self, model: Callable[[list[str], int], tuple[int, int]], name: str, largest: int,
                 count: int) -> np.ndarray:
        """What nvCOMP holds beyond our buffers during a call, as the encoder and decoder budget
        for it (``encode_scratch`` / ``decode_scratch`` for the largest chunk of the call):
        counted in the device's live bytes while the call runs."""
        fixed, per_chunk = model([name], largest)
        return self.device.scratch(fixed + per_chunk * count)

    def encode_into(self, inputs: list[Any], buffer: Any, offsets: list[int], capacity: int) -> list[int]:
        """Compress each input into ``buffer`` at its offset; the stream sizes."""
        self.device.record("encode", self, len(inputs))
        scratch = self._scratch(encode_scratch, self.user_name, max((int(x.nbytes) for x in inputs), default=0),
                                len(inputs))
        sizes = []
        for data, offset in zip(inputs, offsets):
            stream = self._compress(data)
            if len(stream) > capacity:
                raise RuntimeError(f"fake nvCOMP: stream of {len(stream)} bytes exceeds its {capacity}")
            buffer[offset:offset + len(stream)] = np.frombuffer(stream, dtype=np.uint8)
            sizes.append(len(stream))
        del scratch
        return sizes

    def decode_into(self, inputs: list[Any], buffer: Any, offsets: list[int], sizes: list[int]) -> list[int]:
        """Decompress each stream into ``buffer`` at its offset; the decoded sizes. A stream that
        does not decode raises what nvCOMP's Python API raises for one (``RuntimeError`` naming
        ``nvcompErrorCannotDecompress``); one that decodes to more than its room, ``ValueError``."""
        self.device.record("decode", self, len(inputs))
        scratch = self._scratch(decode_scratch, str(self.stage()["name"]), max(sizes, default=0), len(inputs))
        got = []
        for data, offset, size in zip(inputs, offsets, sizes):
            try:
                raw = self._decompress(data, size)
            except (ValueError, zstandard.ZstdError, zlib.error) as err:  # the CPU codecs' "damaged stream"
                raise RuntimeError(f"nvcompErrorCannotDecompress: {err}") from err
            if len(raw) > size:
                raise ValueError(f"stream decodes to {len(raw)} bytes, room for {size}")
            out = np.frombuffer(raw, dtype=np.uint8)
            if self.delta is not None and self.device.garble_lossy:
                out = out ^ np.uint8(1)  # values other than the rounded ones: the check must catch it
            buffer[offset:offset + len(raw)] = out
            got.append(len(raw))
        del scratch
        return got

    def close(self) -> None:
        """Mark closed (the real one destroys the nvCOMP codec)."""
        self.closed = True


class FakeDevice:
    """``DeviceBackend`` on NumPy (see the module docstring)."""

    xp = np

    def __init__(self) -> None:
        self.codecs: dict[tuple[str, str | None, float | None], FakeCodec] = {}
        self.calls: list[tuple[str, str, str | None, float | None, int]] = []
        """(operation, codec, data type, delta, batch size) per codec call, in order."""
        self.fail: dict[str, BaseException] = {}
        """Operation ("encode", "decode", "crc32c", "upload", "codec") -> error its next call raises."""
        self.garble_lossy = False
        self.allocated = Counter[str]()
        self.live_bytes = 0
        """"Device" bytes allocated by ``empty`` and still referenced (views keep their base alive,
        as a CuPy view keeps its memory)."""
        self.peak_bytes = 0
        """The most ``live_bytes`` reached."""
        self._live_lock = threading.Lock()
        self.device_threads: set[int] = set()
        self.closed = 0
        self.free = 16 << 30
        """What ``free_bytes`` reports."""
        self._current = threading.local()

    # -- bookkeeping -------------------------------------------------------------------------
    def _check(self, operation: str) -> None:
        """Fail like CUDA does on a thread without a current device, and inject faults."""
        if threading.get_ident() not in self.device_threads and not getattr(self._current, "depth", 0):
            raise AssertionError(f"{operation} on a thread that made no device current")
        error = self.fail.pop(operation, None)
        if error is not None:
            raise error

    def record(self, operation: str, codec: FakeCodec, count: int) -> None:
        """Note a codec call (and raise an injected fault)."""
        self._check(operation)
        self.calls.append((operation, codec.user_name, codec.data_type, codec.delta, count))

    # -- DeviceBackend -----------------------------------------------------------------------
    def use_in_thread(self) -> None:
        """Mark the calling thread as having the device current."""
        self.device_threads.add(threading.get_ident())

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """The device current for the block (the fake runs everything synchronously)."""
        self._current.depth = getattr(self._current, "depth", 0) + 1
        try:
            yield
        finally:
            self._current.depth -= 1

    def synchronize(self) -> None:
        """Nothing queued: the fake is synchronous."""

    def wait_for_current_streams(self) -> None:
        """Nothing queued elsewhere either; recorded in ``calls``."""
        self.calls.append(("wait_for_current_streams", "", None, None, 0))

    def empty(self, nbytes: int) -> np.ndarray:
        """New "device" memory, filled with ``GARBAGE``."""
        self.allocated["bytes"] += nbytes
        self.allocated["arrays"] += 1
        array = np.full(nbytes, GARBAGE, dtype=np.uint8)
        with self._live_lock:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(array, self._released, nbytes)
        return array

    def scratch(self, nbytes: int) -> np.ndarray:
        """Memory a codec call holds while it runs (``FakeCodec._scratch``): counted in
        ``live_bytes`` like ``empty``'s, neither filled nor counted in ``allocated``."""
        array = np.empty(nbytes, dtype=np.uint8)
        with self._live_lock:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(array, self._released, nbytes)
        return array

    def _released(self, nbytes: int) -> None:
        with self._live_lock:
            self.live_bytes -= nbytes

    def free_bytes(self) -> int:
        return self.free

    def address(self, array: np.ndarray) -> int:
        """The array's data pointer."""
        return int(array.__array_interface__["data"][0])

    def upload(self, out: np.ndarray, host: np.ndarray) -> None:
        """Copy host bytes in."""
        self._check("upload")
        out[...] = host

    def to_host(self, array: np.ndarray) -> np.ndarray:
        """A copy."""
        return np.array(array)

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        self.allocated["pinned"] += nbytes
        return np.empty(nbytes, dtype=np.uint8)

    def download(self, out: np.ndarray, array: np.ndarray) -> None:
        self._check("download")
        out[:] = array

    def zero_fill(self, views: list[np.ndarray]) -> None:
        """Zero each view."""
        self._check("zero_fill")
        for view in views:
            view[...] = 0

    def planes_inverse_to(self, planes: np.ndarray, address: int, width: int) -> None:
        """Undo the planes on the host, then copy to the address (host memory: the fake's
        "device" pointers)."""
        self._check("planes_inverse_to")
        self.calls.append(("planes_inverse_to", "", None, None, 1))
        assert address % width == 0
        out = planes_inverse_into(planes, np.empty(planes.nbytes, dtype=np.uint8), width)
        ctypes.memmove(address, out.ctypes.data, out.nbytes)

    def copy_out(self, raw: np.ndarray, places: list[tuple[int, int, int]]) -> None:
        """Copy each range to its address."""
        self._check("copy_out")
        self.calls.append(("copy_out", "", None, None, len(places)))
        for offset, length, address in places:
            assert offset + length <= raw.nbytes
            ctypes.memmove(address, raw.ctypes.data + offset, length)

    def gather(self, ranges: list[tuple[int, int, int]], into: np.ndarray) -> None:
        """Copy host memory at the given addresses (the fake's "device" pointers)."""
        self._check("gather")
        self.calls.append(("gather", "", None, None, len(ranges)))
        base = into.ctypes.data
        for address, position, length in ranges:
            assert position + length <= into.nbytes
            ctypes.memmove(base + position, address, length)

    def crc32c(self, buffers: list[np.ndarray]) -> list[int]:
        """The format's CRC-32C, computed on the host."""
        self._check("crc32c")
        return [checksum(buffer) for buffer in buffers]

    def verified_ans_decode(self, bodies: list[np.ndarray], expected: list[int],
                            outputs: list[np.ndarray | None]) -> CheckedBatch:
        """The checksums on the host, then the fake ANS decoder for the outputs whose checksum
        matched (recorded as one "decode" call); an undecodable stream gets nvCOMP's status 12."""
        self._check("crc32c")
        crcs = np.array([checksum(body) for body in bodies], dtype=np.uint32)
        which = [i for i, out in enumerate(outputs) if out is not None]
        statuses = np.zeros(len(which), dtype=np.int32)
        sizes = np.zeros(len(which), dtype=np.uint64)
        if which:
            codec = self.codec("ans")
            codec.device.record("decode", codec, len(which))
            for j, i in enumerate(which):
                out = outputs[i]
                assert out is not None
                if int(crcs[i]) != expected[i]:
                    statuses[j] = 12  # given no bytes, nvCOMP decodes nothing
                    continue
                try:
                    raw = codec._decompress(bodies[i], out.nbytes)
                except (RuntimeError, ValueError, zstandard.ZstdError):
                    statuses[j] = 12
                    continue
                if len(raw) > out.nbytes:
                    statuses[j] = 12
                    continue
                out[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
                sizes[j] = len(raw)
        return CheckedBatch(crcs=crcs, statuses=statuses, sizes=sizes, decoded_at={i: j for j, i in enumerate(which)})

    def all_true(self, flags: list[Any]) -> list[bool]:
        """Host bools."""
        return [bool(flag) for flag in flags]

    def codec(self, user_name: str, data_type: str | None = None, delta: float | None = None) -> FakeCodec:
        """A cached ``FakeCodec``."""
        error = self.fail.pop("codec", None)
        if error is not None:
            raise error
        key = (user_name, data_type, delta)
        if key not in self.codecs:
            self.codecs[key] = FakeCodec(self, user_name, data_type, delta)
        return self.codecs[key]

    def forget_codecs(self) -> None:
        """Drop the codecs unclosed."""
        self.codecs.clear()

    def close(self) -> None:
        """Close every codec."""
        self.closed += 1
        for codec in self.codecs.values():
            codec.close()
        self.codecs.clear()
