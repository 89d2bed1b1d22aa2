"""POSIX file backend for host buffers: positional writes and reads from a thread pool.

Atomicity: a save writes to a temporary file in the target's directory, fsyncs it, renames it
over the target (``os.replace``, atomic on POSIX) and fsyncs the directory, so the target path
always holds either the previous complete checkpoint or the new complete one. A crash leaves at
most a temporary file named ``.<target>.gdsckpt-tmp-*``, which readers never open and the next
save to the same target removes (``remove_stale_temporaries``).

O_DIRECT: used where the filesystem accepts it (not tmpfs) and the buffer, offset and length are
4 KiB aligned, which the pipeline guarantees for chunk payloads. It skips the page cache, which on
the measured hosts nearly doubles durable write throughput (1.9 vs 1.0 GB/s).
"""

from __future__ import annotations

import errno
import os
import secrets
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from ..format.layout import ALIGNMENT
from .base import StorageReader, StorageWriter

TEMP_MARKER = ".gdsckpt-tmp-"


def temporary_path(target: Path) -> Path:
    """A fresh temporary path beside ``target`` (same directory, so the rename is atomic)."""
    return target.with_name(f".{target.name}{TEMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}")


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove temporaries of earlier saves to ``target`` whose writing process no longer exists."""
    removed = []
    prefix = f".{target.name}{TEMP_MARKER}"
    try:
        candidates = [p for p in target.parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return removed
    for path in candidates:
        pid_text = path.name[len(prefix):].split("-", 1)[0]
        if pid_text.isdigit() and _process_alive(int(pid_text)):
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped: an orphan under a PID 1 that does not reap) writes nothing.
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def publish(temp: Path, target: Path, *, fsync: bool) -> None:
    """Rename a complete temporary file over ``target`` (atomic on POSIX) and, with ``fsync``,
    fsync the directory so the rename is durable. A failed rename removes the temporary file."""
    try:
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    if fsync:
        fsync_directory(target.parent)


def fsync_directory(directory: Path) -> None:
    """fsync a directory so a rename inside it is durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_aligned(data: np.ndarray, offset: int) -> bool:
    return (offset % ALIGNMENT == 0 and data.nbytes % ALIGNMENT == 0
            and data.ctypes.data % ALIGNMENT == 0)


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        view = view[written:]
        offset += written


class PosixWriter(StorageWriter):
    """Writes a checkpoint to ``target`` through a temporary file and an atomic rename."""

    def __init__(self, target: str | os.PathLike[str], *, threads: int = 8, o_direct: bool | str = "auto",
                 fsync: bool = True):
        self.target = Path(target)
        self.fsync = fsync
        remove_stale_temporaries(self.target)
        self.temp = temporary_path(self.target)
        self._fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._direct_fd: int | None = None
        if o_direct and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = os.open(self.temp, os.O_WRONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                if o_direct is True:
                    self.abort()
                    raise
        self.name = "posix+odirect" if self._direct_fd is not None else "posix"
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="gdsckpt-write")
        self._closed = False
        self.keep_temporary = False
        """When True, ``commit`` makes the temporary file durable and leaves the rename over the
        target to the caller (``gdsckpt.worker``: the process that owns the snapshot commits)."""

    def submit_write(self, offset: int, data: Any) -> Future[None]:
        fd = self._fd
        if self._direct_fd is not None and isinstance(data, np.ndarray) and _is_aligned(data, offset):
            fd = self._direct_fd
        return self._pool.submit(self._write, fd, data, offset)

    def _write(self, fd: int, data: Any, offset: int) -> None:
        try:
            _pwrite_all(fd, data, offset)
        except OSError as err:
            if fd == self._direct_fd and err.errno == errno.EINVAL:
                _pwrite_all(self._fd, data, offset)  # the filesystem refused this O_DIRECT write
            else:
                raise

    def write_tail(self, offset: int, data: bytes) -> None:
        _pwrite_all(self._fd, data, offset)
        os.ftruncate(self._fd, offset + len(data))

    def commit(self) -> None:
        self._pool.shutdown(wait=True)
        if self.fsync:
            os.fsync(self._fd)
        self._close_fds()
        if self.keep_temporary:
            self._closed = True
            return
        publish(self.temp, self.target, fsync=self.fsync)
        self._closed = True

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._close_fds()
        try:
            self.temp.unlink()
        except OSError:
            pass

    def _close_fds(self) -> None:
        for fd in (self._direct_fd, self._fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._direct_fd = None
        self._fd = -1


class PosixReader(StorageReader):
    """Positional reads from a thread pool into caller-provided host arrays."""

    name = "posix"

    def __init__(self, path: str | os.PathLike[str], *, threads: int = 8, o_direct: bool | str = False):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.size = os.fstat(self._fd).st_size
        self._direct_fd: int | None = None
        if o_direct and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                if o_direct is True:
                    self.close()
                    raise
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="gdsckpt-read")

    def read(self, offset: int, length: int) -> bytes:
        out = np.empty(length, dtype=np.uint8)
        self._read_into(self._fd, offset, out)
        return out.tobytes()

    def submit_read(self, offset: int, out: np.ndarray) -> Future[np.ndarray]:
        fd = self._direct_fd if self._direct_fd is not None and _is_aligned(out, offset) else self._fd
        return self._pool.submit(self._read_into, fd, offset, out)

    def _read_into(self, fd: int, offset: int, out: np.ndarray) -> np.ndarray:
        view = memoryview(out).cast("B")
        position = offset
        while view:
            count = os.preadv(fd, [view], position)
            if count == 0:
                raise CorruptCheckpointError(
                    f"file ends at {position}, inside a range [{offset}, +{out.nbytes}) the index names"
                )
            view = view[count:]
            position += count
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in (self._direct_fd, self._fd):
            if fd is not None and fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._direct_fd = None
        self._fd = -1
