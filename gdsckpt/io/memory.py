"""In-memory target and null sink: storage backends that measure the pipeline past the disk.

``MemoryWriter`` assembles the file in a host ``bytearray`` (device buffers are copied to the host
by the caller's engine) and on ``commit`` publishes it in a ``MemoryStore`` under its name, where a
``MemoryReader`` can load it back. ``NullWriter`` accepts every write and keeps nothing: a save to
it measures flattening, transforms, compression and checksums alone.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from .base import StorageReader, StorageWriter


def _done(value: Any = None) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _host_bytes(data: Any) -> memoryview:
    if hasattr(data, "__cuda_array_interface__") and not hasattr(data, "__array_interface__"):
        data = data.get()  # a CuPy array: one copy to the host
    return np.ascontiguousarray(data).data.cast("B")


class MemoryStore:
    """A dictionary of named in-memory checkpoint files, safe to use from several threads."""

    def __init__(self) -> None:
        self._files: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, name: str, data: bytes) -> None:
        with self._lock:
            self._files[name] = data

    def get(self, name: str) -> bytes:
        with self._lock:
            if name not in self._files:
                raise FileNotFoundError(f"no in-memory checkpoint named {name!r}")
            return self._files[name]


class MemoryWriter(StorageWriter):
    """Builds the file in memory; ``commit`` publishes it in ``store`` under ``name`` atomically."""

    name = "memory"

    def __init__(self, store: MemoryStore, name: str):
        self.store, self.file_name = store, name
        self._buffer = bytearray()
        self._lock = threading.Lock()

    def submit_write(self, offset: int, data: Any) -> Future[None]:
        self._put(offset, _host_bytes(data))
        return _done()

    def _put(self, offset: int, view: memoryview) -> None:
        with self._lock:
            end = offset + len(view)
            if end > len(self._buffer):
                self._buffer.extend(bytes(end - len(self._buffer)))
            self._buffer[offset:end] = view

    def write_tail(self, offset: int, data: bytes) -> None:
        self._put(offset, memoryview(data))
        del self._buffer[offset + len(data):]

    def commit(self) -> None:
        self.store.put(self.file_name, bytes(self._buffer))
        self._buffer = bytearray()

    def abort(self) -> None:
        self._buffer = bytearray()


class NullWriter(StorageWriter):
    """Discards every byte. ``commit`` publishes nothing; there is nothing to load back."""

    name = "null"

    def __init__(self) -> None:
        self.bytes_written = 0

    def submit_write(self, offset: int, data: Any) -> Future[None]:
        self.bytes_written += int(getattr(data, "nbytes", None) or len(data))
        return _done()

    def write_tail(self, offset: int, data: bytes) -> None:
        self.bytes_written += len(data)

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass


class MemoryReader(StorageReader):
    """Reads a checkpoint published in a ``MemoryStore``."""

    name = "memory"

    def __init__(self, store: MemoryStore, name: str):
        self._data = store.get(name)
        self.size = len(self._data)

    def read(self, offset: int, length: int) -> bytes:
        if offset + length > self.size:
            raise CorruptCheckpointError(f"range [{offset}, +{length}) runs past the end of the file")
        return self._data[offset:offset + length]

    def submit_read(self, offset: int, out: np.ndarray) -> Future[np.ndarray]:
        out[:] = np.frombuffer(self.read(offset, out.nbytes), dtype=np.uint8)
        return _done(out)

    def close(self) -> None:
        pass
