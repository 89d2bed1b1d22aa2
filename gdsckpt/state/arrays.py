"""Array adapters: the ``ArraySource`` the save pipeline reads a torch / NumPy / CuPy array's bytes
from, and the ``ArrayTarget`` the restore pipeline writes an array's bytes into, one per
library (JAX through DLPack)."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format.dtypes import DTYPES
from .dtypes import numpy_dtype, torch_dtype

# ---------------------------------------------------------------------------------------------
# sources (save side)

def torch_range(tensor: Any, start: int, stop: int) -> Any:
    """Elements ``[start, stop)`` of ``tensor`` in C order as a contiguous 1-D tensor, copying at
    most about one chunk even when ``tensor`` is a non-contiguous view."""
    if tensor.is_contiguous():
        return tensor.reshape(-1)[start:stop]
    if tensor.dim() == 1:
        return tensor[start:stop].contiguous()
    import torch

    row = tensor.numel() // tensor.shape[0]
    first, last = start // row, (stop - 1) // row
    if first == last:
        return torch_range(tensor[first], start - first * row, stop - first * row)
    pieces = [torch_range(tensor[first], start - first * row, row)]
    if last > first + 1:
        pieces.append(tensor[first + 1:last].contiguous().reshape(-1))
    pieces.append(torch_range(tensor[last], 0, stop - last * row))
    return torch.cat(pieces)


def array_range(array: Any, start: int, stop: int, xp: Any) -> Any:
    """``torch_range`` for NumPy / CuPy arrays."""
    if array.flags.c_contiguous:
        return array.reshape(-1)[start:stop]
    if array.ndim == 1:
        return xp.ascontiguousarray(array[start:stop])
    row = array.size // array.shape[0]
    first, last = start // row, (stop - 1) // row
    if first == last:
        return array_range(array[first], start - first * row, stop - first * row, xp)
    pieces = [array_range(array[first], start - first * row, row, xp)]
    if last > first + 1:
        pieces.append(xp.ascontiguousarray(array[first + 1:last]).reshape(-1))
    pieces.append(array_range(array[last], 0, stop - last * row, xp))
    return xp.concatenate(pieces)


def _byte_view(flat: Any) -> Any:
    """The bytes of a contiguous one-dimensional torch tensor, as a uint8 view of its memory."""
    import torch

    if flat.numel() == 1 and flat.stride(0) != 1:
        # torch calls one element contiguous whatever its stride, but view() to bytes needs 1
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def read_on_cupy_stream(tensor: Any, *, made: bool) -> None:
    """Order the read of CUDA ``tensor`` on CuPy's current stream (the GPU encoder's, a
    non-blocking stream: nothing orders it after torch's) after the work queued so far on torch's
    current stream, which may still be writing it (a copy of a non-contiguous range, a rounding).
    ``made``: the tensor was made for this read and is dropped once the read is queued, so torch's
    allocator is told that CuPy's stream uses its memory (``record_stream``); otherwise it could
    hand the memory to a new tensor, and a kernel write it, before the queued read ran.

    CuPy's import of a torch tensor already waits for the stream torch names in it; what this adds
    is the ordering where that stream is not the one torch copied on, and the memory's lifetime.
    One GPU test once loaded a transposed CUDA view with other bytes than saved (valid checksums:
    the wrong bytes were written); it did not recur, and the stress test beside it
    (tests/gpu/test_gpu_reliability.py) passed without this guard too: a guard, not a measured fix."""
    import cupy
    import torch

    reader = cupy.cuda.get_current_stream()
    writer = torch.cuda.current_stream(tensor.device)
    if reader.ptr == writer.cuda_stream:
        return
    done = torch.cuda.Event()
    done.record(writer)
    cupy.cuda.runtime.streamWaitEvent(reader.ptr, done.cuda_event)
    if made:
        tensor.record_stream(torch.cuda.ExternalStream(reader.ptr, device=tensor.device))


@dataclass
class _SourceBase:
    nbytes: int
    itemsize: int
    plane_width: int
    on_device: bool


class TorchSource(_SourceBase):
    """Reads a torch tensor's element bytes (CPU or CUDA, any layout)."""

    def __init__(self, tensor: Any, dtype_name: str, on_device: bool | None = None):
        spec = DTYPES[dtype_name]
        super().__init__(tensor.numel() * spec.itemsize, spec.itemsize, spec.plane_width,
                         tensor.device.type == "cuda" if on_device is None else on_device)
        # A lazy conjugate / negative view reads as values its memory does not hold: materialize it.
        # Detached only where autograd tracks it: a detached view is one more object per tensor
        # that outlives the save's phases (``collector``), and reads need no autograd either way.
        if tensor.requires_grad:
            tensor = tensor.detach()
        if tensor.is_conj() or tensor.is_neg():
            tensor = tensor.resolve_conj().resolve_neg()
        self.tensor = tensor
        self._device_whole: Any = None
        """A CuPy uint8 array over the whole tensor's memory (contiguous CUDA tensors), made on
        the first ``device_bytes``: see there."""

    def _part(self, start: int, stop: int) -> Any:
        return _byte_view(torch_range(self.tensor, start // self.itemsize, stop // self.itemsize))

    def host_bytes(self, start: int, stop: int) -> np.ndarray:
        """Bytes ``[start, stop)`` of the tensor as a host uint8 array (copied from its GPU for a
        CUDA tensor)."""
        tensor = self.tensor
        if start == 0 and stop == self.nbytes and not tensor.is_cuda and tensor.is_contiguous():
            # The whole of a CPU tensor, as a small tensor packed with others into a chunk is read:
            # one byte view, without the range arithmetic and slicing (a state of 100,000 small
            # tensors paid them per tensor, in codec threads that contend for the interpreter lock).
            return _byte_view(tensor.reshape(-1)).numpy()
        part = self._part(start, stop)
        return (part.cpu() if part.device.type != "cpu" else part).numpy()

    def device_bytes(self, start: int, stop: int) -> Any:
        """Bytes ``[start, stop)`` as a CuPy uint8 array on the tensor's device: a view of its
        memory where the range is one contiguous piece of it, else a new array.

        A contiguous CUDA tensor is imported into CuPy once, as a whole, and each range is a
        slice of that view. Why: the GPU encoder reads a large tensor as one range per chunk, and
        importing each range through torch (a view, ``__cuda_array_interface__``, CuPy's wait on
        the stream it names, the stream-ordering event below) cost about 90 us of the worker
        thread's time per chunk, about a quarter of the save's time into a null sink. The
        ordering after torch's current stream (``read_on_cupy_stream``) is then made once per
        tensor, on its first read: nothing the save does writes a tensor it reads in place, and
        the save synchronized the device before its first read (``api.saving._save_engine``)."""
        import cupy

        if self._device_whole is not None:
            return self._device_whole[start:stop]
        if self.tensor.device.type == "cuda" and self.nbytes and self.tensor.is_contiguous():
            whole = _byte_view(self.tensor.reshape(-1))
            read_on_cupy_stream(whole, made=False)
            view = cupy.asarray(whole)
            if view.data.ptr != whole.data_ptr():  # a copy would leave later writes unseen
                raise RuntimeError("CuPy view of the source tensor does not alias its memory")
            self._device_whole = view
            return view[start:stop]
        part = self._part(start, stop)
        if part.device.type != "cuda":
            return cupy.asarray(part.numpy())
        # a non-contiguous range is a new tensor torch copied on its current stream
        made = part.untyped_storage().data_ptr() != self.tensor.untyped_storage().data_ptr()
        read_on_cupy_stream(part, made=made)
        return cupy.asarray(part)

    def device_span(self, start: int, stop: int) -> int | None:
        """The device address of bytes ``[start, stop)`` where they are one contiguous range of a
        CUDA tensor (the GPU encoder then gathers them with a kernel, without an array object
        per range), else None."""
        tensor = self.tensor
        if not self.on_device or not tensor.is_contiguous():
            return None
        return int(tensor.data_ptr()) + start


class NumpySource(_SourceBase):
    """Reads a NumPy array's element bytes (any layout, either byte order)."""

    def __init__(self, array: np.ndarray, dtype_name: str):
        spec = DTYPES[dtype_name]
        super().__init__(array.size * spec.itemsize, spec.itemsize, spec.plane_width, False)
        self.array = array

    def host_bytes(self, start: int, stop: int) -> np.ndarray:
        """Bytes ``[start, stop)`` of the array as uint8, little-endian (a big-endian array's
        elements are swapped)."""
        part = array_range(self.array, start // self.itemsize, stop // self.itemsize, np)
        if part.dtype.byteorder == ">" or (part.dtype.byteorder == "=" and sys.byteorder == "big"):
            part = part.astype(part.dtype.newbyteorder("<"))
        return part.view(np.uint8)

    def device_bytes(self, start: int, stop: int) -> Any:
        """``host_bytes`` copied to the current GPU as a CuPy array."""
        import cupy

        return cupy.asarray(self.host_bytes(start, stop))


class CupySource(_SourceBase):
    """Reads a CuPy array's element bytes."""

    def __init__(self, array: Any, dtype_name: str):
        spec = DTYPES[dtype_name]
        super().__init__(array.size * spec.itemsize, spec.itemsize, spec.plane_width, True)
        self.array = array

    def device_bytes(self, start: int, stop: int) -> Any:
        """Bytes ``[start, stop)`` as a CuPy uint8 array on the array's device."""
        import cupy

        with cupy.cuda.Device(self.array.device.id):
            part = array_range(self.array, start // self.itemsize, stop // self.itemsize, cupy)
            return part.view(cupy.uint8)

    def host_bytes(self, start: int, stop: int) -> np.ndarray:
        """``device_bytes`` copied to host memory."""
        return self.device_bytes(start, stop).get()

    def device_span(self, start: int, stop: int) -> int | None:
        """As ``TorchSource.device_span``."""
        if not self.array.flags.c_contiguous:
            return None
        return int(self.array.data.ptr) + start


# ---------------------------------------------------------------------------------------------
# targets (restore side)

class _Target:
    nbytes: int
    on_device: bool
    private_memory = False
    """True where the memory ``host_view`` hands out was allocated by this target, so that no
    other target of a restore can share it (the restore's overlap check then skips it)."""

    def write_device(self, start: int, data: Any) -> None:
        self.write_host(start, data.get())

    def write_host(self, start: int, data: np.ndarray) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def host_view(self, start: int, stop: int) -> np.ndarray | None:
        """Bytes ``[start, stop)`` of the destination as a writable uint8 array over its own
        memory, for reading file bytes straight into it; None where the destination is not
        contiguous host memory (the restore then writes through ``write_host``)."""
        return None

    def host_span(self) -> tuple[int, int] | None:
        """Addresses ``[first, end)`` of the host memory ``host_view`` hands out (None where it
        hands out none): a restore reads into no memory that another of its targets writes."""
        return None

    def device_address(self, start: int) -> tuple[int, int] | None:
        """(CUDA device index, address of byte ``start``) where the destination is contiguous
        device memory a GPU decoder may write itself (``Decoder.submit_decode``'s ``places``);
        None where it is not (the restore then writes through ``write_device``)."""
        return None


@contextlib.contextmanager
def writable(tensor: Any) -> Iterator[None]:
    """A context in which ``tensor`` can be written in place: no autograd recording, and inference
    mode for a tensor made under it (an inference tensor is written only there). Inference mode
    is entered only for such a tensor: ``torch.inference_mode(False)`` switches grad mode back on,
    and a leaf that requires grad (a non-contiguous Parameter) then refuses the in-place copy."""
    import torch

    with torch.no_grad(), (torch.inference_mode() if tensor.is_inference() else contextlib.nullcontext()):
        yield


_UNMADE: Any = object()
"""A lazily made view not made yet (None is a made one: an empty array has no bytes to view)."""


class TorchTarget(_Target):
    """A torch tensor to fill: a new one, or an existing one (``load_into``) written in place."""

    def __init__(self, shape: tuple[int, ...], dtype_name: str, device: str, *, existing: Any = None,
                 parameter: bool | None = None):
        import torch

        self.existing = existing
        self.parameter = parameter
        if existing is not None and existing.is_contiguous():
            self.tensor = existing.detach()
        else:
            self.tensor = torch.empty(shape, dtype=torch_dtype(dtype_name), device=device)
            self.private_memory = True
        self.nbytes = self.tensor.numel() * self.tensor.element_size()
        self.on_device = self.tensor.is_cuda
        self._device_view: Any = None
        self._flat_view: Any = _UNMADE
        self._host_view: Any = _UNMADE

    # The byte views are made on first use: a restore makes a target per tensor before reading
    # anything, and a GPU decoder that writes the tensor's memory itself (``device_address``)
    # never needs them. Not functools.cached_property: before Python 3.12 it takes one lock shared
    # by every instance, which serialised the restore threads' first writes and, held by one
    # thread when another forked, hung the child's next load for good. Two threads making a view
    # at once make two equal views.
    @property
    def _flat(self) -> Any:
        view = self._flat_view
        if view is _UNMADE:
            view = self._flat_view = _byte_view(self.tensor.reshape(-1)) if self.nbytes else None
        return view

    @property
    def _host(self) -> np.ndarray | None:
        view = self._host_view
        if view is _UNMADE:
            view = self._host_view = self._flat.numpy() if self.nbytes and not self.on_device else None
        return view

    def write_host(self, start: int, data: np.ndarray) -> None:
        """Copy the host bytes ``data`` into the tensor from byte ``start`` (through a view of its
        memory where it is in host memory)."""
        if self._host is not None:
            self._host[start:start + data.nbytes] = data
            return
        import torch

        assert self._flat is not None
        host = data if data.flags.writeable else data.copy()
        self._flat[start:start + data.nbytes].copy_(torch.from_numpy(host))

    def host_view(self, start: int, stop: int) -> np.ndarray | None:
        """A writable NumPy view of bytes ``[start, stop)`` of a host tensor's memory; None for a
        CUDA tensor."""
        return self._host[start:stop] if self._host is not None else None

    def host_span(self) -> tuple[int, int] | None:
        """(first, end) host address of a host tensor's bytes; None for a CUDA tensor."""
        if self._host is None:
            return None
        start = self.tensor.data_ptr()
        return start, start + self.nbytes

    def device_address(self, start: int) -> tuple[int, int] | None:
        """(device, address) of byte ``start`` of a CUDA tensor; None for a host or empty tensor."""
        if not self.on_device or not self.nbytes:
            return None
        return self.tensor.get_device(), self.tensor.data_ptr() + start

    def write_device(self, start: int, data: Any) -> None:
        """Copy the device bytes ``data`` into the tensor from byte ``start`` (through host memory
        where the tensor is there)."""
        import cupy

        assert self._flat is not None
        if not self.on_device:  # decoded on a GPU, destined for host memory
            self.write_host(start, cupy.asnumpy(data))
            return
        # A CuPy copy on the caller's current stream (the GPU engine's), which the engine
        # synchronizes once per batch: no cross-stream hazard with torch's stream. The view must
        # alias the tensor's memory: a silent copy would leave the tensor unwritten. Made once per
        # target: a large tensor takes one piece per chunk.
        view = self._device_view
        if view is None:
            view = cupy.asarray(self._flat)
            if view.data.ptr != self._flat.data_ptr():
                raise RuntimeError("CuPy view of the destination tensor does not alias its memory")
            self._device_view = view
        view[start:start + data.nbytes] = data

    def finish(self) -> Any:
        """The filled tensor: ``existing`` where one was given (its autograd version bumped, or
        filled by a copy where it is not contiguous), else the new tensor, as a ``Parameter``
        where one was saved."""
        import torch

        if self.existing is not None:
            if self.tensor is not self.existing and not self.existing.is_contiguous():
                with writable(self.existing):
                    self.existing.copy_(self.tensor)
            else:
                # Written through NumPy / CuPy views of its memory, which autograd does not see: a
                # graph that saved the old values would run backward() on the new ones without the
                # "modified by an inplace operation" error that load_state_dict's copy_ raises.
                torch.autograd.graph.increment_version(self.existing)
            return self.existing
        if self.parameter is not None:
            return torch.nn.Parameter(self.tensor, requires_grad=self.parameter)
        return self.tensor


class NumpyTarget(_Target):
    """A new NumPy array (or scalar) to fill."""

    on_device = False
    private_memory = True

    def __init__(self, shape: tuple[int, ...], dtype_name: str, *, scalar: bool = False):
        self.array = np.empty(shape, dtype=numpy_dtype(dtype_name))
        self.scalar = scalar
        self.nbytes = self.array.nbytes
        self._flat = self.array.reshape(-1).view(np.uint8)

    def write_host(self, start: int, data: np.ndarray) -> None:
        """Copy ``data`` into the array's bytes from byte ``start``."""
        self._flat[start:start + data.nbytes] = data

    def host_view(self, start: int, stop: int) -> np.ndarray | None:
        """A writable view of the array's bytes ``[start, stop)``."""
        return self._flat[start:stop]

    def host_span(self) -> tuple[int, int] | None:
        """(first, end) address of the array's bytes."""
        start = self._flat.ctypes.data
        return start, start + self.nbytes

    def finish(self) -> Any:
        """The filled array (its single element for a saved NumPy scalar)."""
        return self.array[()] if self.scalar else self.array


class CupyTarget(_Target):
    """A new CuPy array to fill on a given device."""

    on_device = True

    def __init__(self, shape: tuple[int, ...], dtype_name: str, device_id: int):
        import cupy

        with cupy.cuda.Device(device_id):
            self.array = cupy.empty(shape, dtype=numpy_dtype(dtype_name))
            self._flat = self.array.reshape(-1).view(cupy.uint8)
        self.nbytes = self.array.nbytes

    def write_host(self, start: int, data: np.ndarray) -> None:
        """Copy the host bytes ``data`` to the array from byte ``start`` (host to device)."""
        self._flat[start:start + data.nbytes].set(np.ascontiguousarray(data))

    def write_device(self, start: int, data: Any) -> None:
        """Copy the device bytes ``data`` into the array from byte ``start``."""
        self._flat[start:start + data.nbytes] = data

    def device_address(self, start: int) -> tuple[int, int] | None:
        """(device, address) of byte ``start``; None for an empty array."""
        return (self.array.device.id, self.array.data.ptr + start) if self.nbytes else None

    def finish(self) -> Any:
        """The filled CuPy array."""
        return self.array


class JaxTarget(NumpyTarget):
    """A JAX array, assembled on the host and handed to JAX through DLPack."""

    def __init__(self, shape: tuple[int, ...], dtype_name: str, device: str | None):
        importlib.import_module("jax")  # before anything is read: ImportError if JAX is missing
        super().__init__(shape, dtype_name)
        self.device = device

    def finish(self) -> Any:
        """The filled host array as a JAX array (through DLPack), put on the GPU ``device`` names
        where it names one."""
        import jax

        array = jax.dlpack.from_dlpack(self.array) if self.array.size else jax.numpy.asarray(self.array)
        if self.device and self.device.startswith("cuda"):
            gpus = jax.devices("gpu")
            index = int(self.device.split(":")[1]) if ":" in self.device else 0
            array = jax.device_put(array, gpus[index])
        return array


