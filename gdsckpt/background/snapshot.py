"""Snapshots for background saves: copies of a state's arrays into pooled buffers, so that the
caller may change its tensors as soon as ``save_async`` returns.

``SnapshotPool`` keeps buffers between saves, keyed by size (host, pinned host, or on the GPU);
``take_snapshot`` copies a state into them (tied views share one copy) and rebuilds the
containers. ``gdsckpt.background.async_save`` describes when each kind of buffer is used and the
pool's memory bound.
"""

from __future__ import annotations

import collections
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..state import flatten
from ..state.tree import plain_key

PathLike = str | os.PathLike[str]




@dataclass(frozen=True)
class PoolStats:
    """What a ``SnapshotPool`` holds and has done."""

    allocations: int
    """Buffers allocated since the pool was created (or cleared)."""
    allocated_bytes: int
    """Bytes of those buffers."""
    reuses: int
    """Buffer requests served by a buffer the pool already held."""
    buffers: int
    """Buffers held now (idle + lent to a snapshot)."""
    held_bytes: int
    """Bytes held now (idle + lent)."""
    lent_bytes: int
    """Bytes lent to snapshots of saves in flight."""
    dropped: int
    """Idle buffers dropped to keep the pool within its bound."""


class SnapshotPool:
    """Host buffers for snapshots, keyed by (kind, size), kept between saves. Thread-safe.

    Kinds: ``"numpy"`` (``np.empty``), ``"torch"`` (CPU ``torch.empty``), ``"pinned"``
    (page-locked ``torch.empty(pin_memory=True)``, for copies from CUDA tensors), ``"cuda:N"``
    (``torch.empty`` on GPU N, for device-side snapshots); for a save worker process
    (``Config.async_worker="process"``) ``"shared"`` and ``"shared-pinned"`` in place of
    ``"torch"`` and ``"pinned"``: memory both processes map (``gdsckpt.background.worker.shared_host_buffer``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[Any]] = collections.defaultdict(list)
        self._lent: collections.Counter[tuple[str, int]] = collections.Counter()
        self._allocations = 0
        self._allocated_bytes = 0
        self._reuses = 0
        self._dropped = 0
        self._budget: int | None = None
        """The bound the last ``release`` kept the pool within (``copies`` x its snapshot's bytes)."""

    def acquire(self, kind: str, nbytes: int) -> Any:
        """A buffer of ``nbytes`` bytes (1-D uint8) of ``kind``: an idle one, or a new one."""
        key = (kind, nbytes)
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                self._reuses += 1
                self._lent[key] += 1
                return idle.pop()
            # A size no idle buffer has: a state whose arrays changed size. Idle buffers of the
            # old sizes were dropped only when this snapshot was released, so while it ran the
            # pool held the old state's buffers beside the new (twice the bound): those beyond
            # the bound go first, whichever this snapshot might still have reused.
            if self._budget is not None:
                self._drop_idle(self._held_bytes() + nbytes, self._budget)
        buffer = _allocate(kind, nbytes)
        with self._lock:
            self._allocations += 1
            self._allocated_bytes += nbytes
            self._lent[key] += 1
        return buffer

    def release(self, lent: list[tuple[tuple[str, int], Any]], *, copies: int = 1, failed: bool = False) -> None:
        """Take back the buffers of one snapshot. The pool then holds at most ``copies`` times the
        bytes of that snapshot: idle buffers beyond that are dropped, sizes the snapshot did not
        use first. That bound is kept while the next snapshot allocates too (``acquire``), unless
        this one ``failed`` part-way (its bytes are not the state's)."""
        wanted: collections.Counter[tuple[str, int]] = collections.Counter(key for key, _ in lent)
        budget = copies * sum(key[1] for key, _ in lent)
        with self._lock:
            if not failed:
                self._budget = budget
            for key, buffer in lent:
                self._lent[key] -= 1
                self._idle[key].append(buffer)
            held = self._held_bytes()
            if held <= budget:
                return
            # First idle buffers of sizes this snapshot did not use (or used fewer of), then any.
            held = self._drop_idle(held, budget, lambda key, count: count + self._lent[key] <= copies * wanted[key])
            self._drop_idle(held, budget)

    def _drop_idle(self, held: int, budget: int,
                   keep: Callable[[tuple[str, int], int], bool] | None = None) -> int:
        """Drop idle buffers while ``held`` bytes exceed ``budget`` (caller holds the lock), but
        none of a size for which ``keep(key, idle count)`` says so; returns the bytes then held."""
        for key in list(self._idle):
            idle = self._idle[key]
            while idle and held > budget and (keep is None or not keep(key, len(idle))):
                idle.pop()
                held -= key[1]
                self._dropped += 1
            if not idle:
                del self._idle[key]
        return held

    def clear(self) -> int:
        """Drop every idle buffer; returns the bytes freed. Buffers lent to saves in flight stay
        with their snapshots and are dropped when those saves end."""
        with self._lock:
            freed = sum(key[1] * len(idle) for key, idle in self._idle.items())
            self._dropped += sum(len(idle) for idle in self._idle.values())
            self._idle.clear()
            return freed

    def stats(self) -> PoolStats:
        """The pool's counters now (``PoolStats``): allocations and reuses so far, buffers and bytes
        held and lent, buffers dropped."""
        with self._lock:
            return PoolStats(
                allocations=self._allocations, allocated_bytes=self._allocated_bytes, reuses=self._reuses,
                buffers=sum(len(v) for v in self._idle.values()) + sum(self._lent.values()),
                held_bytes=self._held_bytes(), lent_bytes=sum(k[1] * n for k, n in self._lent.items()),
                dropped=self._dropped,
            )

    def _held_bytes(self) -> int:
        return (sum(key[1] * len(idle) for key, idle in self._idle.items())
                + sum(key[1] * n for key, n in self._lent.items()))


def _allocate(kind: str, nbytes: int) -> Any:
    if kind == "numpy":
        return np.empty(nbytes, dtype=np.uint8)
    if kind.startswith("shared"):  # host memory a save worker process maps too
        from .worker import shared_host_buffer

        return shared_host_buffer(nbytes, pin=kind == "shared-pinned")
    import torch

    if kind.startswith("cuda"):
        return torch.empty(nbytes, dtype=torch.uint8, device=kind)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")


# ---------------------------------------------------------------------------------------------
# taking a snapshot

class _Snapshotter:
    """Rebuilds a state with every array copied into pool buffers."""

    def __init__(self, pool: SnapshotPool, *, cuda_on_device: bool = False, shared: bool = False):
        self.pool = pool
        self.cuda_on_device = cuda_on_device
        self.shared = shared
        self.lent: list[tuple[tuple[str, int], Any]] = []
        self.views: dict[tuple[Any, ...], Any] = {}
        self.cuda_devices: set[Any] = set()
        self.torch = sys.modules.get("torch")
        self.cupy = sys.modules.get("cupy")
        self.jax = sys.modules.get("jax")
        self.nbytes = 0

    def _buffer(self, kind: str, nbytes: int) -> Any:
        buffer = self.pool.acquire(kind, nbytes)
        self.lent.append(((kind, nbytes), buffer))
        self.nbytes += nbytes
        return buffer

    def copy(self, obj: Any) -> Any:
        # The structure was validated by flatten(): only supported types reach here.
        if isinstance(obj, np.generic) or obj is None:
            return obj  # immutable
        if isinstance(obj, (bool, int, float, str)):
            # Immutable; a subclass (an IntEnum, a str-mixin Enum) as the plain value the file
            # stores for it: a worker process unpickles the snapshot, and a class defined in the
            # caller's script or inside a function is not importable there.
            return plain_key(obj)
        if isinstance(obj, dict):
            items = ((plain_key(key), self.copy(value)) for key, value in obj.items())
            if isinstance(obj, collections.OrderedDict):
                result: dict[Any, Any] = collections.OrderedDict(items)
                metadata = getattr(obj, "_metadata", None)
                if isinstance(metadata, dict):  # plain values as elsewhere (its enums included)
                    result._metadata = self.copy(metadata)  # type: ignore[attr-defined]
                return result
            return dict(items)
        if type(obj) is list:
            return [self.copy(item) for item in obj]
        if type(obj) is tuple:
            return tuple(self.copy(item) for item in obj)
        torch = self.torch
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._torch(obj)
        if isinstance(obj, np.ndarray):
            return self._numpy(obj)
        if self.cupy is not None and isinstance(obj, self.cupy.ndarray):
            with self.cupy.cuda.Device(obj.device.id):
                return self.cupy.array(obj, copy=True)  # on its GPU; not pooled
        if self.jax is not None and isinstance(obj, self.jax.Array):
            return obj  # immutable
        raise TypeError(f"cannot snapshot {type(obj).__qualname__}")  # pragma: no cover - flatten rejects it

    def _torch(self, tensor: Any) -> Any:
        torch = self.torch
        assert torch is not None
        key = None
        if tensor.numel():
            key = ("torch", str(tensor.device), tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                   tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.is_conj(), tensor.is_neg())
        data = self.views.get(key) if key is not None else None
        if data is None:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes == 0:
                data = torch.empty(tuple(tensor.shape), dtype=tensor.dtype)
            else:
                on_cuda = tensor.device.type == "cuda"
                kind = "shared" if self.shared else "torch"
                if on_cuda:
                    kind = (f"cuda:{tensor.device.index or 0}" if self.cuda_on_device
                            else "shared-pinned" if self.shared else "pinned")
                buffer = self._buffer(kind, nbytes)
                data = buffer.view(tensor.dtype).view(tuple(tensor.shape))
                with torch.no_grad():
                    data.copy_(tensor.detach(), non_blocking=on_cuda)
                if on_cuda:
                    self.cuda_devices.add(tensor.device)
            if key is not None:
                self.views[key] = data
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(data, requires_grad=tensor.requires_grad)
        return data

    def _numpy(self, array: np.ndarray) -> np.ndarray:
        key = None
        if array.size:
            # The dtype itself, not its .str: that is "<V1" for every ml_dtypes float8, and a view
            # of one as another would come back as the first view, of its dtype, without an error.
            key = ("numpy", array.__array_interface__["data"][0], array.dtype, array.shape, array.strides)
            if key in self.views:
                return self.views[key]
        if array.nbytes == 0:
            return np.empty(array.shape, dtype=array.dtype)
        data = self._buffer("numpy", array.nbytes).view(array.dtype).reshape(array.shape)
        np.copyto(data, array, casting="no")
        if key is not None:
            self.views[key] = data
        return data

    def finish(self) -> None:
        """Wait for the copies from CUDA tensors (one synchronize per device)."""
        if self.cuda_devices:
            assert self.torch is not None
            for device in self.cuda_devices:
                self.torch.cuda.synchronize(device)


def take_snapshot(state: Any, pool: SnapshotPool, *, validate: bool = True, cuda_on_device: bool = False,
                  shared: bool = False) -> tuple[Any, list[tuple[tuple[str, int], Any]], int]:
    """A copy of ``state`` whose arrays live in buffers of ``pool``; returns the copy, the lent
    buffers (give them back with ``pool.release``) and the bytes copied into them. ``validate``:
    check the state first as ``gdsckpt.save`` does (skip it only when done already).
    ``cuda_on_device``: copy CUDA torch tensors on their GPU instead of into pinned host memory.
    ``shared``: host buffers a save worker process can map (``gdsckpt.background.worker``)."""
    if validate:
        flatten(state)  # the same validation (and TypeError messages) as gdsckpt.save
    snapshotter = _Snapshotter(pool, cuda_on_device=cuda_on_device, shared=shared)
    try:
        snapshot = snapshotter.copy(state)
        snapshotter.finish()
    except BaseException:
        pool.release(snapshotter.lent, copies=1 << 30, failed=True)
        raise
    return snapshot, snapshotter.lent, snapshotter.nbytes

