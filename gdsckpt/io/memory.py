"""In-memory target, null sink and null source: storage backends that measure the pipeline
past the disk.

``MemoryWriter`` assembles the file in a host ``bytearray`` (device buffers are copied to the host
by the caller's engine) and on ``commit`` publishes it in a ``MemoryStore`` under its name, where a
``MemoryReader`` can load it back. ``NullWriter`` accepts every write and keeps nothing: a save to
it measures flattening, transforms, compression and checksums alone. ``PreloadedReader`` holds a
whole checkpoint file in host memory (page-locked where a GPU restore reads it) and serves every
read from there: a restore from it measures checksums, decoding and delivery (with the host to
device copies a GPU restore needs anyway), with the storage taken out.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from .base import StorageReader, StorageWriter, WritePace
from .pools import DRAIN_TIMEOUT, Lane


def done_future(value: Any = None) -> Future[Any]:
    """A future already completed with ``value``: what a backend that writes or reads synchronously
    returns."""
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def host_bytes(data: Any) -> memoryview:
    """``data`` (a host or CuPy array, or a bytes-like object) as a flat byte view in host memory;
    a CuPy array is copied to the host once."""
    if hasattr(data, "__cuda_array_interface__") and not hasattr(data, "__array_interface__"):
        data = data.get()  # a CuPy array: one copy to the host
    return np.ascontiguousarray(data).data.cast("B")


class MemoryStore:
    """A dictionary of named in-memory checkpoint files, safe to use from several threads."""

    def __init__(self) -> None:
        self._files: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, name: str, data: bytes) -> None:
        """Publish ``data`` under ``name``, replacing a file of that name."""
        with self._lock:
            self._files[name] = data

    def get(self, name: str) -> bytes:
        """The bytes published under ``name``; ``FileNotFoundError`` where there are none."""
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
        """Copy ``data`` into the file being built at ``offset``, extending it with zeros as needed;
        done when it returns."""
        self._put(offset, host_bytes(data))
        return done_future()

    def _put(self, offset: int, view: memoryview) -> None:
        with self._lock:
            end = offset + len(view)
            if end > len(self._buffer):
                self._buffer.extend(bytes(end - len(self._buffer)))
            self._buffer[offset:end] = view

    def write_tail(self, offset: int, data: bytes) -> None:
        """Write the final bytes at ``offset`` and cut the file being built there."""
        self._put(offset, memoryview(data))
        del self._buffer[offset + len(data):]

    def commit(self) -> None:
        """Publish the built file in the store under its name, in one step, and drop the buffer."""
        self.store.put(self.file_name, bytes(self._buffer))
        self._buffer = bytearray()

    def abort(self) -> None:
        """Drop the built bytes; the store keeps what it held."""
        self._buffer = bytearray()


class NullWriter(StorageWriter):
    """Discards every byte. ``commit`` publishes nothing; there is nothing to load back."""

    name = "null"

    def __init__(self) -> None:
        self.bytes_written = 0
        """The length of the file these writes would have made (a gap between writes counts,
        as the zeros or the hole a file would hold there)."""

    def submit_write(self, offset: int, data: Any) -> Future[None]:
        """Extend ``bytes_written`` to the end of this write; nothing is kept. Done when it returns."""
        nbytes = getattr(data, "nbytes", None)
        self.bytes_written = max(self.bytes_written, offset + int(len(data) if nbytes is None else nbytes))
        return done_future()

    def write_tail(self, offset: int, data: bytes) -> None:
        """Extend ``bytes_written`` to the end of the final bytes; nothing is kept."""
        self.bytes_written = max(self.bytes_written, offset + len(data))

    def commit(self) -> None:
        """Nothing to publish."""
        pass

    def abort(self) -> None:
        """Nothing to discard."""
        pass

    def backlog(self) -> int | None:
        """0: every write is done when submitted (the storage always waits for the encoder)."""
        return 0

    def pace(self) -> WritePace | None:
        """Nothing pending, at no cost (an infinite speed: compressing saves no time)."""
        return WritePace(0, math.inf)


class MemoryReader(StorageReader):
    """Reads a checkpoint published in a ``MemoryStore``."""

    name = "memory"

    def __init__(self, store: MemoryStore, name: str):
        self._data = store.get(name)
        self.size = len(self._data)

    def read(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of the published file; ``CorruptCheckpointError``
        past its end."""
        if offset + length > self.size:
            raise CorruptCheckpointError(f"range [{offset}, +{length}) runs past the end of the file")
        return self._data[offset:offset + length]

    def submit_read(self, offset: int, out: np.ndarray) -> Future[np.ndarray]:
        """Copy the ``out.nbytes`` bytes at ``offset`` into ``out``; done when it returns."""
        out[:] = np.frombuffer(self.read(offset, out.nbytes), dtype=np.uint8)
        return done_future(out)

    def close(self) -> None:
        """Nothing to release: the store keeps the bytes."""
        pass


class PreloadedReader(StorageReader):
    """A checkpoint file read into host memory once, then read from there: the null source.

    ``source``: a path (read whole when the reader is made) or the file's bytes. ``pinned``: hold
    the bytes in page-locked memory (needs CuPy and a GPU), so that reads into device buffers (a
    GPU restore) copy at the bus's speed; reads into host arrays are memory copies either way.
    Reads run on ``threads`` threads of the shared I/O pool (each device copy makes the buffer's
    device current on its thread first). ``gdsckpt.load(reader, ...)`` restores from it;
    ``close`` leaves it usable, so one reader serves repeated restores."""

    name = "preloaded"

    def __init__(self, source: Any, *, pinned: bool = False, threads: int = 8, timeout: float = DRAIN_TIMEOUT):
        self.timeout = timeout
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = memoryview(source)
            self.size = data.nbytes
            self._data = self._allocate(self.size, pinned)
            self._data[:] = np.frombuffer(data, dtype=np.uint8)
        else:
            from .posix import open_regular  # never blocks on a FIFO: refused as not a regular file

            with open(open_regular(source), "rb", buffering=0) as handle:
                self.size = os.fstat(handle.fileno()).st_size
                self._data = self._allocate(self.size, pinned)
                view, done = self._data.data, 0
                while done < self.size:
                    got = handle.readinto(view[done:])
                    if not got:
                        raise CorruptCheckpointError(f"{source!r} shrank while being read")
                    done += got
        self._lane = Lane("io", threads)
        self._streams = threading.local()
        """Per I/O thread: device id -> the CuPy stream its copies run on."""

    @property
    def data(self) -> np.ndarray:
        """The file's bytes as held (page-locked with ``pinned``): a benchmark's raw copy of the
        same bytes is the null source's limit."""
        return self._data

    def read(self, offset: int, length: int) -> bytes:
        """A copy of bytes ``[offset, offset + length)`` of the held file;
        ``CorruptCheckpointError`` outside it."""
        if offset < 0 or offset + length > self.size:
            raise CorruptCheckpointError(f"range [{offset}, +{length}) runs past the end of the file")
        return self._data[offset:offset + length].tobytes()

    def submit_read(self, offset: int, out: Any) -> Future[Any]:
        """Copy ``out.nbytes`` bytes at ``offset`` into ``out``: a host array, or a CuPy array on
        a GPU (a host-to-device copy)."""
        nbytes = int(out.nbytes)
        if offset < 0 or offset + nbytes > self.size:
            raise CorruptCheckpointError(f"range [{offset}, +{nbytes}) runs past the end of the file")
        return self._lane.submit(self._copy, self._data[offset:offset + nbytes], out)

    def _copy(self, source: np.ndarray, out: Any) -> Any:
        if hasattr(out, "__cuda_array_interface__") and not hasattr(out, "__array_interface__"):
            import cupy

            with cupy.cuda.Device(out.device.id):
                # On a stream of this thread's own, waited for: CuPy copies on the current stream
                # asynchronously, and the decoder reads the buffer on a non-blocking stream that
                # does not wait for the default one (a restore then saw half-copied chunks).
                streams = self._streams.__dict__
                stream = streams.get(out.device.id)
                if stream is None:
                    stream = streams[out.device.id] = cupy.cuda.Stream(non_blocking=True)
                out.set(source, stream=stream)
                stream.synchronize()
        else:
            out[:] = source
        return out

    @staticmethod
    def _allocate(size: int, pinned: bool) -> np.ndarray:
        """``size`` bytes of host memory, page-locked where ``pinned``."""
        if pinned:
            import cupy

            return np.frombuffer(cupy.cuda.alloc_pinned_memory(max(size, 1)), dtype=np.uint8, count=size)
        return np.empty(size, dtype=np.uint8)

    def close(self) -> None:
        """Wait for the reads in flight. The bytes stay: the reader serves any number of restores
        (``load`` closes the reader it was given), and its memory goes when it does."""
        lane, self._lane = self._lane, Lane("io", self._lane.threads)
        lane.close(self.timeout)
