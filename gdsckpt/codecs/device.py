"""The device side of the codecs: the transforms' device twins and the device backend seam.

Device twins of the CPU transforms in ``cpu.py``, written once against the array API that CuPy
and NumPy share (slicing, ``reshape``, transposed assignment), so the GPU encoder, the GPU decoder
and ``codec="auto"``'s sampling run the same code on CuPy arrays, and the CPU test suite runs it on
NumPy arrays:

- ``planes_forward_into`` / ``planes_inverse_into``: byte planes (``byteplanes/1``, the bytes of
  ``cpu.planes_forward_reference`` / ``planes_inverse_reference``) into a caller's buffer;
- ``ans_data_type``: the typed-ANS map (element width -> nvCOMP ANS ``data_type``);
- ``same_values``: the float comparison that accepts a Bitcomp lossy stream;
- the CRC-32C of device buffers is the backend's ``crc32c`` (nvCOMP's, ``nvcomp_c``, on the GPU),
  equal to ``gdsckpt.format.checksum`` on the same bytes;
- ``CheckedBatch``: what ``verified_ans_decode`` (checksums and ANS decoding queued together,
  nothing waited for) reports once the stream has finished.

``DeviceBackend`` is everything the GPU encoder and decoder ask of a device: buffers, copies, the
stream, nvCOMP codecs in batches, CRC-32C and padding. ``CudaDevice`` implements it with CuPy,
nvCOMP and nvCOMP's GPU CRC; the test suite has a NumPy stand-in (``tests/fake_device.py``) with
the same interface, so the encoder's and decoder's logic (ring, batching, fallbacks) runs without
a GPU. Nothing in the package constructs anything but ``CudaDevice``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

ANS_DATA_TYPES = {2: "<f2", 4: "<f4"}
"""Element width -> the data type of nvCOMP ANS's typed mode. For floats it beats bytes mode and
byte planes (bf16 N(0, 0.02): 1.51 with ``<f2`` against 1.28 as bytes; fp32: 1.20 with ``<f4``
against 1.09; docs/performance.md)."""


def ans_data_type(width: int) -> str | None:
    """nvCOMP ANS's typed-mode data type for ``width``-byte elements, or None (bytes mode)."""
    return ANS_DATA_TYPES.get(width)


def planes_forward_into(data: Any, out: Any, width: int) -> Any:
    """Byte planes of ``data`` (a uint8 array of whole ``width``-byte elements) written into
    ``out[:data.nbytes]``, which is returned: most significant bytes first, the bytes of
    ``cpu.planes_forward_reference``. CuPy or NumPy arrays (both the same kind); on CuPy one
    word-wise kernel (``_PLANES``) where the element width and alignment allow."""
    count = data.nbytes // width
    if not _planes_kernel(data, out, width, "forward", count):
        out[:data.nbytes].reshape(width, count)[...] = data.reshape(count, width)[:, ::-1].T
    return out[:data.nbytes]


def planes_inverse_into(data: Any, out: Any, width: int) -> Any:
    """Undo ``planes_forward_into``: ``data`` (byte planes) back into element order in
    ``out[:data.nbytes]``, which is returned. ``out`` must not overlap ``data``."""
    count = data.nbytes // width
    if not _planes_kernel(data, out, width, "inverse", count):
        out[:data.nbytes].reshape(count, width)[:, ::-1] = data.reshape(width, count).T
    return out[:data.nbytes]


_PLANES = r"""
// Byte planes, one element per thread: plane k holds byte (WIDTH-1-k) of every little-endian
// element (the most significant first). Each thread reads or writes its element as one aligned
// word and its WIDTH plane bytes, which neighbouring threads make contiguous in every plane.
// CuPy's strided byte copy (the array-API form above) measured several times slower.
template <typename Word, int WIDTH>
__device__ void forward(const Word* data, unsigned char* planes, unsigned long long count) {
    for (unsigned long long j = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; j < count;
         j += (unsigned long long)gridDim.x * blockDim.x) {
        Word word = data[j];
#pragma unroll
        for (int k = 0; k < WIDTH; ++k) planes[k * count + j] = (unsigned char)(word >> (8 * (WIDTH - 1 - k)));
    }
}
template <typename Word, int WIDTH>
__device__ void inverse(const unsigned char* planes, Word* data, unsigned long long count) {
    for (unsigned long long j = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; j < count;
         j += (unsigned long long)gridDim.x * blockDim.x) {
        Word word = 0;
#pragma unroll
        for (int k = 0; k < WIDTH; ++k) word = (Word)((word << 8) | planes[k * count + j]);
        data[j] = word;
    }
}
extern "C" __global__ void forward2(const unsigned short* d, unsigned char* p, unsigned long long n) {
    forward<unsigned short, 2>(d, p, n); }
extern "C" __global__ void forward4(const unsigned int* d, unsigned char* p, unsigned long long n) {
    forward<unsigned int, 4>(d, p, n); }
extern "C" __global__ void forward8(const unsigned long long* d, unsigned char* p, unsigned long long n) {
    forward<unsigned long long, 8>(d, p, n); }
extern "C" __global__ void inverse2(const unsigned char* p, unsigned short* d, unsigned long long n) {
    inverse<unsigned short, 2>(p, d, n); }
extern "C" __global__ void inverse4(const unsigned char* p, unsigned int* d, unsigned long long n) {
    inverse<unsigned int, 4>(p, d, n); }
extern "C" __global__ void inverse8(const unsigned char* p, unsigned long long* d, unsigned long long n) {
    inverse<unsigned long long, 8>(p, d, n); }
"""


def _planes_kernel(data: Any, out: Any, width: int, direction: str, count: int) -> bool:
    """Run ``_PLANES``'s kernel for ``direction`` on CuPy arrays whose elements are 2, 4 or 8
    bytes wide and whose element side is aligned to it; False (nothing done) otherwise."""
    if width not in (2, 4, 8) or count == 0 or not hasattr(data, "data") or not hasattr(data.data, "ptr"):
        return False
    if not (data.flags.c_contiguous and out.flags.c_contiguous):
        return False
    import cupy

    words = data if direction == "forward" else out
    if words.data.ptr % width:
        return False
    kernel = _raw_kernel(cupy, _PLANES, f"{direction}{width}")
    threads = 256
    blocks = min((count + threads - 1) // threads, 16384)
    kernel((blocks,), (threads,), (data, out, np.uint64(count)))
    return True


def same_values(xp: Any, expected: Any, decoded: Any, itemsize: int) -> Any:
    """A device boolean: whether ``decoded`` holds the floats of ``expected`` (uint8 arrays of
    ``itemsize``-byte floats): every element bit for bit (NaN payloads, infinities included),
    except that a zero may come back with the other sign (Bitcomp's lossy mode returns +0.0).
    ``xp``: the array module of both (CuPy, or NumPy in tests)."""
    unsigned = {4: xp.uint32, 2: xp.uint16}[itemsize]
    magnitude = (1 << (8 * itemsize - 1)) - 1
    a, b = expected.view(unsigned), decoded.view(unsigned)
    return xp.all((a == b) | (((a | b) & magnitude) == 0))


@dataclass
class CheckedBatch:
    """What ``DeviceBackend.verified_ans_decode`` queued, to read once the stream has finished:
    the CRC-32C of every body (``crcs``) and, for the bodies it decoded (``decoded_at``: body
    index -> position), nvCOMP's status (0: decoded) and the decoded size."""

    crcs: np.ndarray
    statuses: np.ndarray
    sizes: np.ndarray
    decoded_at: dict[int, int]
    keep: list[Any] = field(default_factory=list)
    """Device and pinned arrays the queued work still uses: held until the batch is read."""

    def problem(self, i: int, expected_crc: int, raw_bytes: int) -> str | None:
        """Why body ``i`` (whose checksum must be ``expected_crc`` and which must decode to
        ``raw_bytes``) is damaged, or None: a checksum mismatch first (its stream was not decoded),
        then a stream nvCOMP could not decode, then one of the wrong size."""
        if int(self.crcs[i]) != expected_crc:
            return "chunk checksum mismatch"
        j = self.decoded_at.get(i)
        if j is None:
            return None
        if int(self.statuses[j]) != 0:
            return f"chunk does not decode (nvCOMP status {int(self.statuses[j])})"
        if int(self.sizes[j]) != raw_bytes:
            return f"chunk decoded to {int(self.sizes[j])} bytes, expected {raw_bytes}"
        return None


class DeviceCodecLike(Protocol):
    """One codec bound to a backend's stream (``nvcomp.DeviceCodec`` on the GPU)."""

    def stage(self) -> dict[str, Any]:
        """The JSON stage naming the bitstream this codec writes."""
        ...

    def max_compressed_bytes(self, probe: Any) -> int:
        """The bound on the stream size of one input the size of ``probe``."""
        ...

    def encode_into(self, inputs: list[Any], buffer: Any, offsets: list[int], capacity: int) -> list[int]:
        """Compress ``inputs`` into ``buffer`` at ``offsets`` (``capacity`` bytes each); stream sizes."""
        ...

    def decode_into(self, inputs: list[Any], buffer: Any, offsets: list[int], sizes: list[int]) -> list[int]:
        """Decompress ``inputs`` into ``buffer`` at ``offsets`` (``sizes`` bytes each); decoded sizes.
        ``ValueError`` or an error ``nvcomp.reports_undecodable`` recognises for a damaged stream."""
        ...

    def close(self) -> None:
        """Release the codec now (after the work queued on its stream)."""
        ...


class DeviceBackend(Protocol):
    """What the GPU encoder and decoder need of a device. One backend per encoder or decoder:
    it owns one stream and the codecs bound to it. Not thread-safe: after construction it is used
    from the owner's worker thread, which calls ``use_in_thread`` first."""

    xp: Any
    """The array module of the device's arrays (``cupy``; ``numpy`` in the fake)."""

    def use_in_thread(self) -> None:
        """Make the device current on the calling thread (a new thread has none)."""
        ...

    def on_stream(self) -> contextlib.AbstractContextManager[Any]:
        """A context in which array operations are queued on the backend's device and stream."""
        ...

    def synchronize(self) -> None:
        """Wait for everything queued on the stream."""
        ...

    def wait_for_current_streams(self) -> None:
        """Wait, in the calling thread, for the work torch and CuPy have queued on this device's
        current streams (work the caller queued before asking for a restore)."""
        ...

    def empty(self, nbytes: int) -> Any:
        """A new uint8 device array."""
        ...

    def free_bytes(self) -> int:
        """Device memory free for new allocations now (a restore sizes its staging from it)."""
        ...

    def address(self, array: Any) -> int:
        """The device address of ``array``'s first byte (identifies views of one buffer)."""
        ...

    def upload(self, out: Any, host: np.ndarray) -> None:
        """Copy host bytes into the device array ``out`` on the stream (asynchronous when
        ``host`` is pinned: ``host`` must then stay alive until the stream is synchronized)."""
        ...

    def to_host(self, array: Any) -> np.ndarray:
        """A host copy of a device array (synchronizes the stream)."""
        ...

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        """A new uint8 host array in page-locked memory (device copies to it run at full speed)."""
        ...

    def download(self, out: np.ndarray, array: Any) -> None:
        """Queue a copy of the device array ``array`` into the host array ``out`` on the stream
        (``out`` from ``pinned_empty``: the copy is asynchronous until ``synchronize``)."""
        ...

    def zero_fill(self, views: list[Any]) -> None:
        """Set every byte of each device array in ``views`` to zero, in one launch."""
        ...

    def planes_inverse_to(self, planes: Any, address: int, width: int) -> None:
        """Queue ``planes_inverse_into`` of the device array ``planes`` into device memory at
        ``address`` (aligned to ``width``; room for ``planes.nbytes``), on the stream."""
        ...

    def copy_out(self, raw: Any, places: list[tuple[int, int, int]]) -> None:
        """Queue copies of ``raw[offset:offset + length]`` to device memory at ``address`` for
        each ``(offset, length, address)`` of ``places``, on the stream."""
        ...

    def gather(self, ranges: list[tuple[int, int, int]], into: Any) -> None:
        """Copy device ranges ``(address, position, length)`` into ``into[position:position +
        length]`` on the stream, in one launch (``address``: a device pointer on this device)."""
        ...

    def crc32c(self, buffers: list[Any]) -> list[int]:
        """CRC-32C (``gdsckpt.format.checksum``) of each device buffer; synchronizes the stream."""
        ...

    def verified_ans_decode(self, bodies: list[Any], expected: list[int], outputs: list[Any | None]) -> CheckedBatch:
        """Queue on the stream, waiting for nothing: the CRC-32C of every body, then nvCOMP ANS
        decompression of ``bodies[i]`` into ``outputs[i]`` (room for exactly the raw bytes) for
        every ``i`` with an output whose checksum equals ``expected[i]``: a stream that fails its
        checksum is never decoded. Read the returned ``CheckedBatch`` after ``synchronize``."""
        ...

    def all_true(self, flags: list[Any]) -> list[bool]:
        """Device booleans (or Python bools) to host bools, with one synchronization."""
        ...

    def codec(self, user_name: str, data_type: str | None = None, delta: float | None = None) -> DeviceCodecLike:
        """The backend's codec for (user-facing name, data type, Bitcomp lossy delta), made once
        and kept until ``close``."""
        ...

    def close(self) -> None:
        """Release the codecs (before the stream they run on)."""
        ...

    def forget_codecs(self) -> None:
        """Drop the codecs without releasing them (a worker that did not stop may be using one)."""
        ...


def synchronize_devices(device_ids: Iterable[int]) -> None:
    """Wait, in the calling thread, for all the work queued on each of these CUDA devices: with
    torch's CUDA initialized, every stream's (``torch.cuda.synchronize``: a caller's side stream
    too, which neither torch's default stream nor the library's streams wait for), else the work
    on CuPy's current stream (``wait_for_current_streams``). What a save does before it reads
    CUDA arrays and ``load_into`` before it writes into them, whichever engine then copies: the
    CPU engine's ``.cpu()`` and host-to-device copies run on its threads' default streams."""
    torch = sys.modules.get("torch")
    for device_id in sorted(set(device_ids)):
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize(device_id)
        else:
            wait_for_current_streams(device_id)


def wait_for_current_streams(device_id: int) -> None:
    """Synchronize, in the calling thread, torch's current stream on CUDA device ``device_id``
    (where torch has initialized CUDA) and CuPy's (where CuPy is imported): the work a caller
    queued there before asking gdsckpt to read or write its arrays on a stream of its own."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.current_stream(device_id).synchronize()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        with cupy.cuda.Device(device_id):
            cupy.cuda.get_current_stream().synchronize()


class CudaDevice:
    """``DeviceBackend`` on a CUDA device: CuPy arrays, one non-blocking stream, nvCOMP codecs
    (ANS through the C API, ``nvcomp_c.AnsCodec``; the others ``nvcomp.DeviceCodec``) and nvCOMP's
    batched CRC-32C (``nvcomp_c``)."""

    def __init__(self, device_id: int):
        import cupy

        from .nvcomp import install_nvcomp_allocator

        install_nvcomp_allocator()
        self.xp = cupy
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._codecs: dict[tuple[str, str | None, float | None], Any] = {}

    def use_in_thread(self) -> None:
        """Make the device current on the calling thread."""
        self.xp.cuda.Device(self.device_id).use()

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """The device and the stream, current for the block."""
        with self.xp.cuda.Device(self.device_id), self.stream:
            yield

    def synchronize(self) -> None:
        """Wait for the stream."""
        self.stream.synchronize()

    def wait_for_current_streams(self) -> None:
        """torch's current stream on the device (where torch has initialized CUDA) and CuPy's,
        each synchronized: the decoder's stream does not wait for them by itself (it is a
        non-blocking stream), so without this a restore could write a tensor that a kernel queued
        before it (an optimizer step) writes after it."""
        wait_for_current_streams(self.device_id)

    def empty(self, nbytes: int) -> Any:
        """A new uint8 CuPy array on the device."""
        with self.xp.cuda.Device(self.device_id):
            return self.xp.empty(nbytes, dtype=self.xp.uint8)

    def free_bytes(self) -> int:
        """Device memory free for new allocations: the driver's free memory plus what CuPy's pool
        holds unused (torch's cache is not counted: it stays torch's)."""
        with self.xp.cuda.Device(self.device_id):
            free, _total = self.xp.cuda.runtime.memGetInfo()
            return int(free) + int(self.xp.get_default_memory_pool().free_bytes())

    def address(self, array: Any) -> int:
        """``array.data.ptr``."""
        return int(array.data.ptr)

    def upload(self, out: Any, host: np.ndarray) -> None:
        """``out.set(host)`` on the stream."""
        out.set(host, stream=self.stream)

    def to_host(self, array: Any) -> np.ndarray:
        """``cupy.asnumpy`` on the stream, then waits for it."""
        host: np.ndarray = self.xp.asnumpy(array, stream=self.stream)
        self.stream.synchronize()
        return host

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        """``cupy.cuda.alloc_pinned_memory`` as a NumPy array (freed when the array goes)."""
        memory = self.xp.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(memory, dtype=np.uint8, count=nbytes)

    def download(self, out: np.ndarray, array: Any) -> None:
        """``array.get(out=out)`` on the stream, not waited for."""
        array.get(stream=self.stream, out=out, blocking=False)

    def zero_fill(self, views: list[Any]) -> None:
        """One kernel launch, one block per view."""
        if not views:
            return
        cupy = self.xp
        starts = cupy.asarray(np.array([v.data.ptr for v in views], dtype=np.uint64))
        lengths = cupy.asarray(np.array([v.nbytes for v in views], dtype=np.int32))
        _raw_kernel(cupy, _ZERO_FILL, "zero_fill")((len(views),), (256,), (starts, lengths))

    def planes_inverse_to(self, planes: Any, address: int, width: int) -> None:
        """``_PLANES``' inverse kernel, its output a raw address (a destination tensor's memory:
        no array object is made for it)."""
        count = planes.nbytes // width
        threads = 256
        _raw_kernel(self.xp, _PLANES, f"inverse{width}")((min((count + threads - 1) // threads, 16384),), (threads,),
                                                         (planes, np.uint64(address), np.uint64(count)))

    def copy_out(self, raw: Any, places: list[tuple[int, int, int]]) -> None:
        """One ``cudaMemcpyAsync`` per place (device to device, on the stream)."""
        runtime = self.xp.cuda.runtime
        source, stream = int(raw.data.ptr), self.stream.ptr
        for offset, length, address in places:
            runtime.memcpyAsync(address, source + offset, length, runtime.memcpyDeviceToDevice, stream)

    def gather(self, ranges: list[tuple[int, int, int]], into: Any) -> None:
        """One kernel launch, one block per range (``_GATHER``)."""
        if not ranges:
            return
        cupy = self.xp
        base = int(into.data.ptr)
        table = np.array([(address, base + position, length) for address, position, length in ranges],
                         dtype=np.uint64)
        on_device = cupy.asarray(table.T.copy())
        _raw_kernel(cupy, _GATHER, "gather")((len(ranges),), (128,), (on_device[0], on_device[1], on_device[2]))

    def crc32c(self, buffers: list[Any]) -> list[int]:
        """nvCOMP's batched CRC32 with the CRC-32C preset (``nvcomp_c``)."""
        from .nvcomp_c import crc32c_batch

        return [int(crc) for crc in crc32c_batch(buffers, self.stream)]

    def verified_ans_decode(self, bodies: list[Any], expected: list[int], outputs: list[Any | None]) -> CheckedBatch:
        """Four launches and two copies, whatever the batch holds: the batch's addresses, sizes
        and checksums go up in one table; nvCOMP's CRC-32C; ``_GATE`` (the ANS batch's stream
        addresses, and its stream sizes with 0 for a checksum mismatch, so that nvCOMP decodes
        nothing of it and reports it undecodable); ``nvcompBatchedANSDecompressAsync``; the
        checksums, statuses and sizes come back into pinned memory."""
        from .nvcomp_c import crc32c_launch

        cupy = self.xp
        count = len(bodies)
        which = [i for i, out in enumerate(outputs) if out is not None]
        decoded = len(which)
        table = np.empty(3 * count + 3 * decoded, dtype=np.uint64)
        table[:count] = [body.data.ptr for body in bodies]
        table[count:2 * count] = [body.nbytes for body in bodies]
        table[2 * count:3 * count] = expected
        table[3 * count:3 * count + decoded] = which
        chosen = [out for out in outputs if out is not None]
        table[3 * count + decoded:3 * count + 2 * decoded] = [out.data.ptr for out in chosen]
        table[3 * count + 2 * decoded:] = [out.nbytes for out in chosen]
        # results: crcs (uint32, count), statuses (int32, decoded), sizes (uint64, decoded)
        layout = count * 4 + decoded * 4
        layout += -layout % 8
        result_bytes = layout + decoded * 8
        with self.xp.cuda.Device(self.device_id):
            on_device = cupy.asarray(table)
            results = cupy.zeros(max(result_bytes, 8), dtype=cupy.uint8)
            crcs = results[:count * 4].view(cupy.uint32)
            base = on_device.data.ptr
            crc32c_launch(base, base + 8 * count, count, int(table[count:2 * count].max()), crcs.data.ptr,
                          self.stream)
            keep: list[Any] = [on_device, results]
            if decoded:
                ans = self.codec("ans").decoder
                misaligned = [i for i, out in zip(which, chosen) if bodies[i].data.ptr % ans.input_alignment
                              or out.data.ptr % ans.output_alignment]
                if misaligned:
                    raise RuntimeError(f"ANS buffers of chunks {misaligned} miss nvCOMP's alignment "
                                       f"({ans.input_alignment} / {ans.output_alignment} bytes)")
                arguments = cupy.empty(2 * decoded, dtype=cupy.uint64)
                keep.append(arguments)
                threads = 128
                _raw_kernel(cupy, _GATE, "gate")(((decoded + threads - 1) // threads,), (threads,),
                                                 (on_device, crcs, np.uint64(count), np.uint64(decoded), arguments))
                ans.decode(arguments.data.ptr, arguments.data.ptr + 8 * decoded,
                                 base + 8 * (3 * count + 2 * decoded), base + 8 * (3 * count + decoded), decoded,
                                 int(table[3 * count + 2 * decoded:].max()),
                                 statuses=results.data.ptr + count * 4, decoded=results.data.ptr + layout)
            host = self.pinned_empty(results.nbytes)
            results.get(stream=self.stream, out=host, blocking=False)
        keep.append(host)
        return CheckedBatch(crcs=host[:count * 4].view(np.uint32),
                            statuses=host[count * 4:count * 4 + decoded * 4].view(np.int32),
                            sizes=host[layout:layout + decoded * 8].view(np.uint64),
                            decoded_at={i: j for j, i in enumerate(which)}, keep=keep)

    def all_true(self, flags: list[Any]) -> list[bool]:
        """Stacks the device booleans and copies them to the host once."""
        on_device = [i for i, flag in enumerate(flags) if not isinstance(flag, (bool, np.bool_))]
        result = [bool(flag) if isinstance(flag, (bool, np.bool_)) else False for flag in flags]
        if on_device:
            values = self.xp.stack([flags[i] for i in on_device]).get()
            for i, value in zip(on_device, values):
                result[i] = bool(value)
        return result

    def codec(self, user_name: str, data_type: str | None = None, delta: float | None = None) -> Any:
        """The codec on the stream, cached by its parameters: ANS through nvCOMP's C API
        (``nvcomp_c.AnsCodec``), the others through its Python API (``nvcomp.DeviceCodec``)."""
        from .nvcomp import DeviceCodec
        from .nvcomp_c import AnsCodec

        key = (user_name, data_type, delta)
        codec = self._codecs.get(key)
        if codec is None:
            if user_name == "ans" and delta is None:
                codec = AnsCodec(stream=self.stream, device_id=self.device_id, data_type=data_type)
            else:
                codec = DeviceCodec(user_name, stream=self.stream, device_id=self.device_id, data_type=data_type,
                                    delta=delta)
            self._codecs[key] = codec
        return codec

    def close(self) -> None:
        """Destroy every nvCOMP codec now, on this thread, not when the collector finds them
        (a codec destroyed by the collector on another thread crashed the process)."""
        codecs = list(self._codecs.values())
        self._codecs.clear()
        with self.xp.cuda.Device(self.device_id):
            for codec in codecs:
                codec.close()

    def forget_codecs(self) -> None:
        """Drop the codecs without destroying them: a worker that did not stop may still be inside
        one (they are then kept for the life of the process, ``nvcomp.DeviceCodec.__del__``)."""
        self._codecs.clear()


_ZERO_FILL = r"""
extern "C" __global__ void zero_fill(unsigned char** starts, const int* lengths) {
    // One block per view: clear its bytes (the padding after a stream, up to the alignment).
    unsigned char* start = starts[blockIdx.x];
    for (int i = threadIdx.x; i < lengths[blockIdx.x]; i += blockDim.x) start[i] = 0;
}
"""
_GATHER = r"""
extern "C" __global__ void gather(const unsigned long long* sources, const unsigned long long* targets,
                                  const unsigned long long* lengths) {
    // One block per range: a packed chunk's small tensors into their places in the slot.
    const unsigned char* source = (const unsigned char*)sources[blockIdx.x];
    unsigned char* target = (unsigned char*)targets[blockIdx.x];
    for (unsigned long long i = threadIdx.x; i < lengths[blockIdx.x]; i += blockDim.x) target[i] = source[i];
}
"""
_GATE = r"""
// The ANS part of a checked batch. table: addresses[n], sizes[n], expected CRCs[n], then for the m
// streams to decode: their body index[m], output addresses[m], output room[m]. Writes the m
// stream addresses and the m stream sizes nvCOMP reads, a size of 0 where the body's CRC (crcs,
// computed on the same stream before) is not the expected one: nvCOMP then decodes nothing.
extern "C" __global__ void gate(const unsigned long long* table, const unsigned int* crcs, unsigned long long n,
                                unsigned long long m, unsigned long long* arguments) {
    unsigned long long j = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (j >= m) return;
    unsigned long long i = table[3 * n + j];
    bool intact = crcs[i] == (unsigned int)table[2 * n + i];
    arguments[j] = table[i];
    arguments[m + j] = intact ? table[n + i] : 0ULL;
}
"""
_modules: dict[tuple[int, str], Any] = {}
_functions: dict[tuple[int, str, str], Any] = {}


def backend_or_cuda(device: DeviceBackend | None, device_id: int) -> DeviceBackend:
    """``device`` where a caller passes one (the NumPy stand-in of the CPU tests), else the real
    backend on CUDA device ``device_id``: what the GPU encoder and decoder run on."""
    return device if device is not None else CudaDevice(device_id)


def _raw_kernel(cupy: Any, source: str, name: str) -> Any:
    """The kernel ``name`` of ``source`` (``_ZERO_FILL``, ``_GATHER``, ``_PLANES``, ``_GATE``) on the current
    device: each source is compiled once per device, as one module whatever kernels it holds."""
    device = cupy.cuda.runtime.getDevice()
    function = _functions.get((device, source, name))
    if function is None:
        module = _modules.get((device, source))
        if module is None:
            module = _modules[(device, source)] = cupy.RawModule(code=source, options=("--std=c++14",))
        function = _functions[(device, source, name)] = module.get_function(name)
    return function
