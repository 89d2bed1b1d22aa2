"""Binary file objects as storage: ``save(state, io.BytesIO())`` and ``load(f)``, as ``torch.save``
and ``torch.load`` take them.

``FileObjectWriter`` writes each chunk into the file object as the save pipeline hands it over,
in file order, filling the padding between chunks with zeros, so a save holds no more of the
file in memory than the pipeline's own in-flight bound (``Config.max_inflight_bytes``); the file
object need not be seekable (a pipe or a socket works). The pipeline submits the header, then the
chunks at ascending offsets, then the tail, which is what lets a stream be written front to back.

``FileObjectReader`` reads ranges of a *seekable* file object on demand: a reader starts at the
trailer at the end of the file, so a stream that cannot seek is refused with a message saying
how to load it (``load(f.read())``). ``bytes`` are read through an ``io.BytesIO`` over them.

Offsets count from where the file object stood when the writer or reader was made, as
``torch.save``/``torch.load`` write and read from the current position. Unlike ``torch.load``, a
read takes the checkpoint to run to the stream's end (its index and trailer are there): one saved
after another into one stream is refused as "appended to", with nothing loaded. Neither class closes the
file object: it belongs to the caller.
"""

from __future__ import annotations

import errno
import io
import os
import threading
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from .base import StorageReader, StorageWriter
from .memory import done_future, host_bytes

_ZEROS = bytes(1 << 16)
"""Padding is written from this buffer, a slice at a time (chunk padding is under 4096 bytes)."""


def is_file_object(obj: Any) -> bool:
    """Whether ``obj`` is a file object a save writes to or a load reads from (not a path, not a
    ``StorageWriter``/``StorageReader``)."""
    if isinstance(obj, (StorageReader, StorageWriter)):
        return False
    return callable(getattr(obj, "read", None)) or callable(getattr(obj, "write", None))


def _check_binary(obj: Any, what: str) -> None:
    """``TypeError`` for a text-mode file object. The standard library's binary classes are binary
    whatever their ``mode`` says (a zip member's is ``"r"``); other objects are judged by a mode
    string without ``"b"`` (gzip's mode is an int)."""
    if isinstance(obj, (io.RawIOBase, io.BufferedIOBase)) and not isinstance(obj, io.TextIOBase):
        return
    mode = getattr(obj, "mode", "b")
    if isinstance(obj, io.TextIOBase) or (isinstance(mode, str) and "b" not in mode):
        raise TypeError(f"{what} needs a binary file object (opened with 'b', or io.BytesIO), got "
                        f"{type(obj).__qualname__} in text mode")


def _appends(fileobj: Any, mode: Any) -> bool:
    """Whether every write of ``fileobj`` goes to the file's end: an ``"a"`` mode, or a descriptor
    opened with ``O_APPEND`` whatever the mode string says (``os.fdopen`` of such a descriptor,
    stdout under a shell's ``>>``)."""
    if isinstance(mode, str) and "a" in mode:
        return True
    if not isinstance(fileobj, (io.FileIO, io.BufferedWriter, io.BufferedRandom)):
        # only the file objects that are a descriptor's own: asking another for its descriptor
        # may change it (a SpooledTemporaryFile moves to disk), and a layer above a descriptor
        # (a GzipFile) has a position of its own
        return False
    try:
        import fcntl  # none on Windows: the mode string is all there is

        return bool(fcntl.fcntl(fileobj.fileno(), fcntl.F_GETFL) & os.O_APPEND)
    except (ImportError, AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return False


def _end_of(fileobj: Any, start: int) -> int:
    """The end of a seekable file object (left positioned there), or ``start`` where it cannot
    seek from the end (a GzipFile being written)."""
    try:
        return int(fileobj.seek(0, io.SEEK_END))
    except (OSError, ValueError):
        return start


class FileObjectWriter(StorageWriter):
    """Writes a checkpoint into a writable binary file object, front to back.

    ``commit`` flushes the file object and, where it can seek, truncates it at the checkpoint's end:
    a save over a longer checkpoint in the same file (``open(p, "r+b")``, a reused ``BytesIO``)
    otherwise left the old index and trailer at the end, and a load of some keys returned the old
    file's arrays without an error. ``abort`` truncates it back to where the save started when it
    is seekable and the save wrote anything (else the partial bytes stay: a stream cannot take
    them back; a save that failed before its first write leaves the file object as it was).
    Unlike a save to a path, a file object is not replaced atomically and not fsynced."""

    name = "fileobj"

    def __init__(self, fileobj: Any):
        if not callable(getattr(fileobj, "write", None)):
            raise TypeError(f"save needs a path or a writable binary file object, got {type(fileobj).__qualname__}")
        _check_binary(fileobj, "save")
        self._file = fileobj
        self._seekable = bool(getattr(fileobj, "seekable", lambda: False)())
        self._start = fileobj.tell() if self._seekable else 0
        mode = getattr(fileobj, "mode", "")
        if self._seekable and _appends(fileobj, mode) and self._start != _end_of(fileobj, self._start):
            # an append-mode file writes at its end whatever its position: the save would land
            # there, behind the old content, and its commit cut the file short of it
            fileobj.seek(self._start)
            raise ValueError(f"save into a file object in append mode (mode {mode!r}, or a descriptor opened "
                             f"with O_APPEND, as a shell's '>>' opens stdout) positioned before its end: its "
                             f"writes go to the end; open it with 'wb' or 'r+b', or seek to its end")
        self._position = 0
        """Bytes written so far, relative to the start."""
        self._wrote = False
        self._held: bytes | None = None
        """The header, until the next write (``submit_write``)."""

    def submit_write(self, offset: int, data: Any) -> Future[None]:
        """Write ``data`` at ``offset`` now (zeros fill any gap since the previous write). The
        header, the save's first write, is held until the next write: a save that fails before
        its first chunk (an encoder's error) leaves the file object as it was."""
        if offset == 0 and not self._wrote and self._held is None:
            self._held = bytes(host_bytes(data))
            return done_future()
        self._write_at(offset, host_bytes(data))
        return done_future()

    def _write_at(self, offset: int, view: memoryview) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._write_at(0, memoryview(held))
        if offset < self._position:
            if not self._seekable:
                raise ValueError(f"write at offset {offset} after {self._position} bytes: the file object "
                                 f"cannot seek back")
            self._file.seek(self._start + offset)
            self._position = offset
        while self._position < offset:
            self._put(memoryview(_ZEROS)[:min(len(_ZEROS), offset - self._position)])
        self._put(view)

    def _put(self, view: memoryview) -> None:
        done = 0
        self._wrote = True
        while done < len(view):
            written = self._file.write(view[done:])
            if written == 0:  # would loop for ever: a stream that takes nothing is broken, as EIO
                raise OSError(errno.EIO, f"the file object took no bytes of a write after "
                                         f"{self._position + done} bytes (its write() returned 0)")
            if written is None and isinstance(self._file, io.RawIOBase):
                # a raw stream returns None when it would block: nothing of this write was taken
                raise BlockingIOError(errno.EAGAIN, f"the file object would block after {self._position + done} "
                                      f"bytes: save needs a blocking stream (a non-blocking pipe or "
                                      f"socket takes what fits and drops the rest)")
            # a raw (unbuffered) file may write less than asked; another file-like that returns
            # None took it all (the ``io`` convention before write returned a count)
            done += len(view) - done if written is None else written
        self._position += len(view)

    def write_tail(self, offset: int, data: bytes) -> None:
        """Write the index and trailer, the file's last bytes."""
        self._write_at(offset, memoryview(data))

    def commit(self) -> None:
        """Truncate the file object at the checkpoint's end where it can seek (class docstring),
        then flush it (the caller closes it)."""
        if self._seekable:
            end = self._start + self._position
            try:
                file_end = self._file.seek(0, io.SEEK_END)
            except (OSError, ValueError):  # seeks forward only (a gzip.GzipFile being written)
                file_end = end
            if file_end > end:  # older bytes after the checkpoint
                self._file.seek(end)
                try:  # older bytes left there would load as its index
                    self._file.truncate()
                except (OSError, ValueError, AttributeError, BufferError) as err:
                    raise OSError(errno.EIO, f"the file object holds older bytes after the checkpoint, "
                                             f"which it cannot truncate ({err}): a load would read "
                                             f"their index") from err
            self._file.seek(end)
        flush = getattr(self._file, "flush", None)
        if flush is not None:
            flush()

    def abort(self) -> None:
        """Take back the partial file where the file object can seek and the save wrote to it."""
        if self._seekable and self._wrote:
            try:
                self._file.seek(self._start)
                self._file.truncate()
            except (OSError, ValueError, AttributeError, BufferError):
                # a file object that cannot truncate (none, closed, a BytesIO whose buffer is
                # exported) keeps the partial bytes; the save's own error is what the caller sees
                pass


class FileObjectReader(StorageReader):
    """Reads a checkpoint from a seekable binary file object, a range at a time, or from a buffer
    (``bytes``, ``bytearray``, ``memoryview``, an mmap's view) in place: ``io.BytesIO`` shares the
    memory of ``bytes`` only, and copied any other buffer whole (a second copy of the file)."""

    name = "fileobj"

    def __init__(self, source: Any):
        self._buffer: memoryview | None = None
        self._file: Any = None
        self._lock = threading.Lock()
        self._closed = False
        """Set by ``close`` under the lock: a read still queued must not move the file object
        from where ``close`` left it."""
        if isinstance(source, (bytes, bytearray, memoryview)):
            view = memoryview(source)
            if not view.c_contiguous:  # a strided view: only a copy is one run of bytes
                view = memoryview(view.tobytes())
            self._buffer = view.cast("B") if (view.format, view.ndim) != ("B", 1) else view
            self._start = 0
            self.size = len(self._buffer)
            return
        if not callable(getattr(source, "read", None)):
            raise TypeError(f"load needs a path, bytes or a readable binary file object, got "
                            f"{type(source).__qualname__}")
        _check_binary(source, "load")
        if not callable(getattr(source, "seekable", None)) or not source.seekable():
            raise ValueError(f"load needs a seekable file object ({type(source).__qualname__} is not): a "
                             f"checkpoint is read from its end first; load its bytes instead, load(f.read())")
        self._file = source
        self._start = source.tell()
        self.size = max(0, source.seek(0, io.SEEK_END) - self._start)  # positioned past its end: empty

    def read(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset``."""
        out = np.empty(length, dtype=np.uint8)
        self._read_into(offset, memoryview(out.data).cast("B"))
        return out.tobytes()

    def _read_into(self, offset: int, view: memoryview) -> None:
        if offset < 0 or offset + len(view) > self.size:
            raise CorruptCheckpointError(f"range [{offset}, +{len(view)}) runs past the end of the file")
        if self._buffer is not None:
            view[:] = self._buffer[offset:offset + len(view)]
            return
        file = self._file
        assert file is not None  # no buffer: a file object
        with self._lock:  # one position per file object: each read seeks and reads under the lock
            if self._closed:
                raise ValueError("the checkpoint's reader of this file object is closed")
            file.seek(self._start + offset)
            done = 0
            while done < len(view):
                readinto = getattr(file, "readinto", None)
                if readinto is not None:
                    got = readinto(view[done:])
                    if got is None:  # a non-blocking stream with no data ready
                        raise BlockingIOError(f"the file object has no data ready at byte {offset + done} "
                                              f"(a non-blocking stream): load from a blocking one")
                else:
                    chunk = file.read(len(view) - done)
                    got = len(chunk)
                    view[done:done + got] = chunk
                if not got:
                    raise CorruptCheckpointError(f"the file object ended at {offset + done} bytes, before "
                                                 f"{offset + len(view)}: it shrank while being read")
                done += got

    def submit_read(self, offset: int, out: Any) -> Future[Any]:
        """Read ``out.nbytes`` bytes at ``offset`` into ``out`` (host, or a CuPy array through host
        memory), now."""
        if hasattr(out, "__cuda_array_interface__") and not hasattr(out, "__array_interface__"):
            out.set(np.frombuffer(self.read(offset, int(out.nbytes)), dtype=np.uint8).reshape(out.shape))
        else:
            self._read_into(offset, memoryview(out).cast("B"))
        return done_future(out)

    def close(self) -> None:
        """Leave the file object open (the caller's to close), positioned after the checkpoint,
        as ``torch.load`` leaves it after what it read."""
        if self._buffer is not None:
            self._buffer.release()  # a bytearray source can be resized again
            return
        with self._lock:
            self._closed = True
            if self._file is not None and not getattr(self._file, "closed", False):
                self._file.seek(self._start + self.size)
