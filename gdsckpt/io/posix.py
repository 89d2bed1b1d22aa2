"""POSIX file backend for host buffers: positional writes and reads from a thread pool.

Atomicity: a save writes to a temporary file in the target's directory, fsyncs it, renames it
over the target (``os.replace``, atomic on POSIX) and fsyncs the directory, so the target path
always holds either the previous complete checkpoint or the new complete one. A crash leaves at
most a temporary file named ``.<target>.gdsckpt-tmp-*``, which readers never open and the next
save to the same target removes (``remove_stale_temporaries``). Where that name would exceed the
file system's NAME_MAX (a legal target name of 230-255 bytes), the target part is shortened and a
digest of the full name keeps it distinct (``temporary_prefix``). A large file replaced by the
rename has its storage freed on a daemon thread (``gdsckpt.io.release``), not inside the rename.

Only regular files are read: ``open_regular`` opens without blocking (a FIFO named like a
checkpoint would otherwise stall the reader until some process writes to it) and refuses anything
that is not a regular file, and ``read_small_file`` reads a pointer or metadata file with a size
cap (``latest`` symlinked to ``/dev/zero`` or to a huge file is refused, not read whole).

Two ways to write a chunk durably, both used by one writer:

- O_DIRECT: used where the filesystem accepts it and the buffer, offset and length are 4 KiB
  aligned, which the pipeline guarantees for compressed payloads. It skips the page cache.
  Consecutive O_DIRECT chunk writes that arrive while ``HOLD_WHILE_RUNNING`` writes are running
  wait and go to storage as one ``pwritev`` of up to ``COALESCE_BYTES``: the size of each write is
  what a small virtual disk rewards, and a write never waits while the storage is idle.
- Buffered, with write-back started at once: anything else, in particular a chunk stored as it
  is, written from the state's own memory (``HostEngine.as_is_views``). Each bulk write
  (``WRITEBACK_MIN_BYTES`` or more) is copied into the page cache and its write-back to storage
  is started right away with ``sync_file_range`` (``start_write_back``) instead of leaving every
  dirty page to the final fsync, so the disk works while later chunks are still being copied.
  On a virtual disk this beat both copies into aligned buffers written with O_DIRECT and buffered
  writes left to the fsync, at 64 and 512 MiB; waiting for each write-back as well, so that a
  write's completion would show the storage's speed, lost most of the gain (docs/performance.md,
  "Save and load on the CPU", with the command that measures it).

The writer also measures its storage (``PosixWriter.pace``: bytes pending, bytes per second while
writing), which the adaptive ``codec="auto"`` of the CPU engine weighs against its codec's speed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import mmap
import os
import secrets
import socket
import stat
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ..format.layout import ALIGNMENT
from . import release
from .base import StorageReader, StorageWriter, WritePace
from .pools import DRAIN_TIMEOUT, Lane

TEMP_MARKER = ".gdsckpt-tmp-"


NAME_MAX = 255
"""Longest file name (bytes) the supported file systems (ext4, xfs, tmpfs, Lustre, GPFS) take."""

_LEGACY_SUFFIX_ROOM = 24
"""``_SUFFIX_ROOM`` before temporaries named their pid space: where a target's name is long
enough to be shortened, its temporaries of those versions start with another prefix."""

_SUFFIX_ROOM = 28
"""Bytes a temporary name needs after its prefix: the writer's pid (up to 10 digits), "-", 8 hex
(this process's token, then the file's own), "." and ``_PID_SPACE`` (8 hex)."""


def _pid_space() -> str:
    """8 hex naming where this process's pid means something: the host's boot (its boot id, else
    its name) and the pid namespace. A pid in a temporary's name is checked only by a process
    of the same space: another container or another node on a shared file system sees other
    processes under those numbers (one with no process of that pid removed a live save's
    temporary, and the save failed at its rename)."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return hashlib.sha256("|".join(parts).encode("utf-8", "surrogateescape")).hexdigest()[:8]


_PID_SPACE = _pid_space()


def _is_pid_space(text: str) -> bool:
    """Whether ``text`` is a pid space as ``_pid_space`` writes one (8 lowercase hex)."""
    return len(text) == 8 and all(c in "0123456789abcdef" for c in text)


FOREIGN_STALE_SECONDS = 3600.0
"""A temporary written in another pid space (``_pid_space``: another container, another node)
is removed as stale only once unchanged this long: its writer's liveness cannot be checked from
here, and a live save writes to its temporary far more often (a stalled one fails within
``Config.timeout``)."""

_process_token = secrets.token_hex(2)
"""4 hex digits naming this process among those that had its pid in its pid space: a process
given the pid its killed predecessor had would otherwise take that predecessor's temporaries
for its own and never remove them. (A container restarted in a fresh pid namespace is another
space, whose predecessor's temporaries go after ``FOREIGN_STALE_SECONDS``.)"""


def _new_process_token() -> None:
    global _process_token
    _process_token = secrets.token_hex(2)


os.register_at_fork(after_in_child=_new_process_token)

_DIGEST_CHARS = 16


def temporary_prefix(target: Path, suffix_room: int = _SUFFIX_ROOM) -> str:
    """What every temporary name of ``target`` starts with: ``.<target name>.gdsckpt-tmp-``, or,
    where that leaves no room for the pid and random suffix within ``NAME_MAX``,
    ``.<head of the name>~<digest of the whole name>.gdsckpt-tmp-``, so a long target name still
    gets a temporary of its own that the next save recognizes."""
    prefix = f".{target.name}{TEMP_MARKER}"
    if len(os.fsencode(prefix)) + suffix_room <= NAME_MAX:
        return prefix
    digest = hashlib.sha256(os.fsencode(target.name)).hexdigest()[:_DIGEST_CHARS]
    head = target.name
    room = NAME_MAX - suffix_room - len(os.fsencode(f".~{digest}{TEMP_MARKER}"))
    while len(os.fsencode(head)) > room:  # by characters, so a multi-byte one is never split
        head = head[:-1]
    return f".{head}~{digest}{TEMP_MARKER}"


def temporary_path(target: Path) -> Path:
    """A fresh temporary path beside ``target`` (same directory, so the rename is atomic), its
    name within ``NAME_MAX``."""
    return target.with_name(f"{temporary_prefix(target)}{os.getpid()}-{_process_token}{secrets.token_hex(2)}"
                            f".{_PID_SPACE}")


def temporary_target(name: str) -> tuple[str, bool] | None:
    """For the name of a temporary file: (the target name it was made for, False), or (the head
    of that name, True) where ``temporary_prefix`` shortened it; None for any other name."""
    if not name.startswith(".") or TEMP_MARKER not in name:
        return None
    shown = name[1:name.index(TEMP_MARKER)]
    head, tilde, digest = shown.rpartition("~")
    if tilde and len(digest) == _DIGEST_CHARS and all(c in "0123456789abcdef" for c in digest):
        return head, True
    return shown, False


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove temporaries of earlier saves to ``target`` whose writing process no longer exists,
    and the temporaries of those temporaries: a conversion saves into a temporary beside its
    destination (``integrations.convert``), whose own save writes a temporary of that name first,
    and a conversion killed meanwhile leaves that one behind."""
    # and the prefix of the versions before pid spaces, whose names needed less room after it
    prefixes = {temporary_prefix(target), temporary_prefix(target, _LEGACY_SUFFIX_ROOM)}
    starts = tuple(prefixes | {f".{prefix}" for prefix in prefixes})
    try:
        candidates = [p for p in target.parent.iterdir() if p.name.startswith(starts)]
    except OSError:
        return []
    return [path for path in candidates if remove_if_stale(path)]


def remove_if_stale(path: Path) -> bool:
    """Remove the temporary file ``path`` if the process that wrote it no longer exists (its pid
    follows the marker in the name); whether it was removed. A temporary of another pid space
    (``_pid_space``, named after the pid) is removed only once unchanged for
    ``FOREIGN_STALE_SECONDS``. Never opens it."""
    # the last marker's: a nested temporary's own writer (its outer name, shortened, may be cut
    # inside the pid after the first)
    pid_text, _dash, rest = path.name[path.name.rindex(TEMP_MARKER) + len(TEMP_MARKER):].partition("-")
    # The space ends the name (a nested temporary's too: one process writes both; the outer
    # name's own may be hidden in a shortened prefix)
    space = path.name[-len(_PID_SPACE):] if path.name[-len(_PID_SPACE) - 1:-len(_PID_SPACE)] == "." else ""
    if pid_text.isdigit() and _is_pid_space(space) and space != _PID_SPACE:
        try:
            if time.time() - path.lstat().st_mtime < FOREIGN_STALE_SECONDS:
                return False
        except OSError:
            return False
    elif pid_text.isdigit():  # of this pid space, or named before pid spaces were (no ".")
        if int(pid_text) == os.getpid():
            if rest.startswith(_process_token):  # this process's own (a save of it still writing)
                return False
        elif _process_alive(int(pid_text)):
            return False
    try:
        path.unlink()
    except OSError:
        return False
    return True


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_regular(path: str | os.PathLike[str], flags: int = os.O_RDONLY) -> int:
    """Open ``path`` (``flags``: read-only by default) and return the descriptor, only if it is a
    regular file (a symlink to one is). Opening never blocks: a FIFO is opened with ``O_NONBLOCK``,
    found not to be a regular file and closed. Raises ``UnsupportedFormatError`` (a checkpoint
    error: the path holds no checkpoint) for anything else, ``OSError`` as ``os.open`` does."""
    fd = os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
            raise UnsupportedFormatError(
                f"{str(path)!r} is {kind}, not a regular file: it holds no checkpoint"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The whole content of the regular file ``path`` (``open_regular``), which must hold at most
    ``limit`` bytes; ``CorruptCheckpointError`` if it holds more (at most ``limit + 1`` bytes are
    read, whatever the file's size)."""
    fd = open_regular(path)
    try:
        parts = []
        left = limit + 1
        while left > 0 and (part := os.read(fd, left)):
            parts.append(part)
            left -= len(part)
    finally:
        os.close(fd)
    data = b"".join(parts)
    if len(data) > limit:
        raise CorruptCheckpointError(
            f"{str(path)!r} holds more than the {limit} bytes a reader accepts there"
        )
    return data


def _process_alive(pid: int) -> bool:
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


def temporary_mode(target: Path) -> int:
    """The permission bits a temporary for ``target`` is created with (``os.open``'s mode, less
    the umask): 0o600 where ``target`` exists, whose own bits it gets at ``publish``
    (``keep_mode``), so that a checkpoint the user made private is never readable by others
    meanwhile; else 0o644, as a new file."""
    return 0o600 if os.path.exists(target) and not os.path.islink(target) else 0o644


def keep_mode(temp: Path, target: Path) -> None:
    """Before ``temp`` replaces ``target``: give it ``target``'s permission bits, as writing the
    file in place (``torch.save``) keeps them, and refuse a ``target`` this process could not
    write (``PermissionError``): the rename needs only the directory's permission, and replaced
    a checkpoint the user had made read-only. Nothing where ``target`` does not exist, or is a
    symlink: the rename replaces the link, not the file it points at (``refuse_special_target``),
    so that file's bits and permissions are not the new file's business."""
    status = refuse_read_only(target)
    if status is not None:
        os.chmod(temp, stat.S_IMODE(status.st_mode))


def refuse_read_only(target: Path) -> os.stat_result | None:
    """``PermissionError`` where ``target`` is a file (not a symlink) this process could not
    write; else its ``lstat`` (None where there is nothing, or a symlink)."""
    try:
        status = os.lstat(target)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(status.st_mode):
        return None
    if not os.access(target, os.W_OK):
        raise PermissionError(errno.EACCES, "permission denied: the file there is read-only, and gdsckpt replaces "
                                            "only a file it could write (chmod u+w it to allow that)", str(target))
    return status


def refuse_special_target(target: Path) -> None:
    """``FileExistsError`` where ``target`` is a FIFO, a device or a socket, or a symlink to one:
    a save or conversion would replace it with a regular file (``/dev/null`` written over by a
    conversion run as root; ``/dev/stdout``, a symlink to the terminal, likewise). A directory is
    left to the rename (``IsADirectoryError``); a symlink to a regular file, or a dangling one, is
    replaced as it is."""
    try:
        mode = os.lstat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    shown = ""
    if stat.S_ISLNK(mode):
        if _links_to_a_descriptor(target):
            raise FileExistsError(errno.EEXIST, f"{str(target)!r} is a symlink to an open file descriptor "
                                                f"(/proc/.../fd, /dev/fd): a checkpoint does not replace it",
                                  str(target))
        shown = " (through a symlink)"
        try:
            mode = os.stat(target).st_mode  # what the link points at
        except OSError:
            return  # dangling, a loop, an unreadable target: the rename decides, as for any path
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
    raise FileExistsError(errno.EEXIST, f"{str(target)!r} is{shown} {kind}, not a regular file: a checkpoint "
                                        f"does not replace it", str(target))


def _links_to_a_descriptor(link: Path) -> bool:
    """Whether a chain of symlinks from ``link`` passes through ``/proc/<pid>/fd`` or ``/dev/fd``
    (``/dev/stdout``): such a link stands for whatever a process has open, a regular file
    included, and a save renamed over it would replace the system's link."""
    current = os.path.abspath(link)  # a relative link resolves from the link's own directory
    for _hop in range(40):  # the kernel's own limit on nested links
        try:
            pointed = os.readlink(current)
        except OSError:
            return False
        current = os.path.join(os.path.dirname(current), pointed)
        normal = os.path.normpath(current)
        if normal.startswith(("/proc/", "/dev/fd/")) and "/fd/" in normal + "/":
            return True
    return False


def publish(temp: Path, target: Path, *, fsync: bool, replace: bool = True,
            timeout: float = DRAIN_TIMEOUT) -> None:
    """Make the complete temporary file ``temp`` visible at ``target`` in one atomic step and,
    with ``fsync``, fsync the directory so that step is durable. The one publish step of the
    package: saves, the save worker, the manager's pointer, DCP metadata, conversions and the
    autotune cache all end here (``write_atomically`` for small files).

    ``replace=True`` renames over an existing ``target`` (atomic on POSIX). ``replace=False``
    refuses an existing one with ``FileExistsError``, also one created while ``temp`` was being
    written: a hard link fails on an existing name where a rename would clobber it (on a
    filesystem without hard links, a check then a rename). A failed step removes ``temp``; after
    a hard link ``temp`` stays, for the caller to remove. A large file replaced has its storage
    freed in the background (``gdsckpt.io.release``). The directory's fsync is waited for at most
    ``timeout`` seconds (``TimeoutError``: ``target`` is in place, its rename maybe not yet
    durable)."""
    held = None
    try:
        refuse_special_target(target)
        if replace:
            keep_mode(temp, target)
            held = release.RELEASER.hold(target)
            os.replace(temp, target)
        else:
            try:
                os.link(temp, target)
            except FileExistsError:
                raise
            except OSError:
                if os.path.lexists(target):
                    raise FileExistsError(errno.EEXIST, "file exists", str(target)) from None
                os.replace(temp, target)
    except BaseException:
        if held is not None:
            os.close(held)
        Path(temp).unlink(missing_ok=True)
        raise
    try:
        if fsync:
            fsync_directory(target.parent, timeout=timeout, renamed=target)
    finally:
        release.RELEASER.release(held)


def write_atomically(target: Path, data: bytes, *, fsync: bool, timeout: float = DRAIN_TIMEOUT) -> None:
    """Replace ``target`` with ``data``: written to a temporary file beside it
    (``temporary_path``), fsynced with ``fsync`` (waited for at most ``timeout`` seconds, as the
    directory's), then ``publish``ed. Readers see the old content or the new, never a part; a
    failure leaves ``target`` as it was and no temporary file."""
    temp = temporary_path(target)
    fd = -1
    try:
        # in the try: a ^C the instant os.open returns loses the descriptor, not the temporary
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), temporary_mode(target))
        pwrite_all(fd, data, 0)
        if fsync:
            fsync_within(fd, timeout, repr(str(temp)))
    except TimeoutError:
        temp.unlink(missing_ok=True)  # the descriptor is the running fsync's (``fsync_within``)
        raise
    except FileExistsError:
        raise  # the name was taken before us: not ours to remove
    except BaseException:
        _close_quietly(fd)
        temp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        publish(temp, target, fsync=fsync, timeout=timeout)
    except BaseException:
        # Not renamed (a ^C as publish began): nothing else removes a live process's temporary.
        # Once renamed it is gone, and once linked the target keeps the data.
        temp.unlink(missing_ok=True)
        raise


def fsync_within(fd: int, timeout: float, what: str) -> None:
    """``os.fsync(fd)`` on a thread of the I/O pool, waited for at most ``timeout`` seconds, so
    that a storage that never completes it (an NFS server gone) fails the call instead of hanging
    it: ``TimeoutError`` naming ``what``, and the descriptor then belongs to the running fsync,
    which closes it when it ends (closing it under the fsync could let its number be reused). Any
    other outcome leaves the descriptor to the caller."""
    synced = Lane("io", 1).submit(os.fsync, fd)
    try:
        synced.result(timeout=timeout)
    except (TimeoutError, FutureTimeout):
        synced.add_done_callback(lambda _ended: _close_quietly(fd))
        raise TimeoutError(f"the fsync of {what} did not complete within {timeout} s") from None


def fsync_directory(directory: Path, *, timeout: float = DRAIN_TIMEOUT, renamed: Path | None = None) -> None:
    """fsync a directory so a rename inside it is durable, waiting at most ``timeout`` seconds
    (``fsync_within``; the message names ``renamed``, already in place, where given)."""
    what = f"directory {str(directory)!r}" + (f" (after {str(renamed)!r} was put in place)" if renamed else "")
    fsync_path(directory, timeout=timeout, what=what)


def fsync_path(path: Path, *, timeout: float = DRAIN_TIMEOUT, what: str | None = None) -> None:
    """fsync the file or directory at ``path`` (its data on storage), waiting at most ``timeout``
    seconds (``fsync_within``, naming ``what`` or the path)."""
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else 0))
    what = what if what is not None else repr(str(path))
    try:
        fsync_within(fd, timeout, what)
    except TimeoutError:
        raise  # the descriptor is the running fsync's
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)


def _close_quietly(*fds: int | None) -> None:
    """Close each open descriptor (None and -1 mean none), ignoring errors: used on paths that
    already report a failure, or where the file is done with."""
    for fd in fds:
        if fd is not None and fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _is_aligned(data: np.ndarray, offset: int) -> bool:
    return (offset % ALIGNMENT == 0 and data.nbytes % ALIGNMENT == 0
            and data.ctypes.data % ALIGNMENT == 0)


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of ``data`` (a bytes-like object) at ``offset`` of ``fd``, looping over short
    writes; ``OSError`` when the system reports an error or a write makes no progress."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        view = view[written:]
        offset += written


def pwritev_all(fd: int, buffers: list[Any], offset: int) -> None:
    """Write ``buffers`` (bytes-like objects) back to back from ``offset`` of ``fd`` with
    ``pwritev``, looping over short writes; ``OSError`` as ``pwrite_all``."""
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    views = [view for view in views if view.nbytes]
    while views:
        written = os.pwritev(fd, views, offset)
        if written <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += written
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if written:
            views[0] = views[0][written:]


WRITEBACK_MIN_BYTES = 1 << 20
"""Buffered writes from this size on start their write-back at once (``start_write_back``);
smaller ones (the header, the index) are left to the final fsync."""
_SYNC_FILE_RANGE_WRITE = 2
"""Linux's SYNC_FILE_RANGE_WRITE: start writing the range's dirty pages, do not wait."""


def _linux_libc_function(name: str, argtypes: list[Any]) -> Any:
    """libc's function ``name`` (returning an int) on Linux, or None elsewhere or where libc lacks
    it: what Python's ``os`` module does not offer."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


_sync_file_range = _linux_libc_function("sync_file_range",
                                        [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])


def can_write_back() -> bool:
    """Whether ``start_write_back`` can start a range's write-back on this system (Linux)."""
    return _sync_file_range is not None


def start_write_back(fd: int, offset: int, nbytes: int) -> None:
    """Start writing bytes ``[offset, offset + nbytes)`` of ``fd`` from the page cache to storage,
    without waiting (``sync_file_range``; durability still comes from fsync, which also writes the
    metadata and flushes the device's cache). An error the system reports raises ``OSError``;
    where the filesystem does not take the call it does nothing."""
    if _sync_file_range is None or nbytes <= 0:
        return
    if _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0:
        return
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ESPIPE, errno.ENOSYS, errno.EOPNOTSUPP):
        return  # nothing to start on this file; the final fsync makes it durable
    raise OSError(code, f"write-back of {nbytes} bytes at {offset}: {os.strerror(code)}")


COALESCE_BYTES = 64 << 20
"""The largest O_DIRECT write a ``PosixWriter`` makes of consecutive chunks (``pwritev``). On a
small virtual disk the size of each write, not the number in flight, limited durable writes
(docs/performance.md, "Save and load on the CPU"); NVMe splits a large write into requests of its
own, so it loses nothing."""
COALESCE_BUFFERS = 512
"""The most buffers one ``pwritev`` takes (Linux's IOV_MAX is 1024)."""
HOLD_WHILE_RUNNING = 2
"""Writes running at which a ``PosixWriter`` holds the next O_DIRECT write back to join it with
those that follow, instead of starting it: fewer running, it starts at once (the storage is never
left idle to fill a larger write)."""


@dataclass
class _Group:
    """Consecutive writes that go to storage as one ``pwritev``."""

    fd: int
    offset: int
    end: int
    buffers: list[Any] = field(default_factory=list)
    futures: list[Future[None]] = field(default_factory=list)


class PosixWriter(StorageWriter):
    """Writes a checkpoint to ``target`` through a temporary file and an atomic rename, at most
    ``threads`` writes at once on the process's shared I/O threads. ``timeout``: seconds
    ``commit`` and ``abort`` wait for writes still running."""

    def __init__(self, target: str | os.PathLike[str], *, threads: int = 8, o_direct: bool | str = "auto",
                 fsync: bool = True, timeout: float = DRAIN_TIMEOUT):
        self.target = Path(target)
        self.fsync = fsync
        self.timeout = timeout
        # Before any file is touched: failing to start an I/O thread leaves the directory as it was.
        self._lane = Lane("io", threads)
        self._closed = False
        self._backlog_lock = threading.Lock()
        self._open: _Group | None = None
        """O_DIRECT writes held back to be joined with the next ones (``submit_write``)."""
        self._fd = -1
        self._direct_fd: int | None = None
        try:
            remove_stale_temporaries(self.target)
            self.temp = temporary_path(self.target)
            self._fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                               temporary_mode(self.target))
            self._open_direct(o_direct, fsync)
        except BaseException as err:
            # An error or a ^C before the writer exists: the caller has nothing to abort, and
            # later saves never remove a live process's temporary. By name, as a ^C the instant
            # os.open returns loses the descriptor (the temporary is ours: O_EXCL, a unique name,
            # unless the name was taken before us).
            self._close_fds()
            if hasattr(self, "temp") and not isinstance(err, FileExistsError):
                self.temp.unlink(missing_ok=True)
            self._lane.close(0.0)
            raise
        self._backlog = 0
        self._running = 0
        """Writes (groups) started and not finished."""
        self._pending_bytes = 0
        self._written_bytes = 0
        self._busy_seconds = 0.0
        self._busy_since = 0.0
        """When ``_running`` last went from 0 to more (``time.monotonic``)."""
        self.keep_temporary = False
        """When True, ``commit`` makes the temporary file durable and leaves the rename over the
        target to the caller (``gdsckpt.background.worker``: the process that owns the snapshot commits)."""

    def _open_direct(self, o_direct: bool | str, fsync: bool) -> None:
        """The O_DIRECT descriptor beside the buffered one (``o_direct`` True: required), and
        what follows from having it or not: whether a write's end shows the storage took it, and
        the writer's ``name``."""
        self._writes_show_storage = False
        """Whether a write's completion says the storage took it: with O_DIRECT, or where the
        filesystem refuses O_DIRECT because its pages are the storage (tmpfs). A buffered write
        to a disk lands in the page cache at memory speed (its write-back at most started) and the
        disk's cost shows at fsync."""
        self._write_back = fsync and can_write_back()
        """Whether bulk buffered writes start their write-back (module docstring); without fsync
        nothing asks for the bytes to be on storage, so neither does a write."""
        if o_direct and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = os.open(self.temp, os.O_WRONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
                self._writes_show_storage = True
            except OSError:
                if o_direct is True:
                    raise
                self._writes_show_storage = True  # refused O_DIRECT: memory-backed
        # Both ways can be in one save (aligned chunks through O_DIRECT, chunks stored as they
        # are buffered with their write-back started): the name lists each one this writer has.
        self.name = ("posix" + ("+odirect" if self._direct_fd is not None else "")
                     + ("+writeback" if self._write_back else ""))

    def submit_write(self, offset: int, data: Any) -> Future[None]:
        """Write ``data`` at ``offset``. An aligned host array goes through the O_DIRECT
        descriptor, joined with the O_DIRECT writes that follow it while ``HOLD_WHILE_RUNNING``
        writes are running (up to ``COALESCE_BYTES``); anything else is written as it comes."""
        future: Future[None] = Future()
        direct_fd = self._direct_fd
        direct = direct_fd is not None and isinstance(data, np.ndarray) and _is_aligned(data, offset)
        fd = direct_fd if direct and direct_fd is not None else self._fd
        start: list[_Group] = []
        nbytes = memoryview(data).nbytes
        with self._backlog_lock:
            self._backlog += 1
            self._pending_bytes += nbytes
            group = self._open
            if group is not None and (not direct or group.end != offset
                                      or group.end - group.offset + data.nbytes > COALESCE_BYTES
                                      or len(group.buffers) >= COALESCE_BUFFERS):
                start.append(group)
                group = self._open = None
            if not direct:
                start.append(_Group(fd, offset, offset + nbytes, [data], [future]))
            else:
                if group is None:
                    group = self._open = _Group(fd, offset, offset)
                group.buffers.append(data)
                group.futures.append(future)
                group.end += data.nbytes
                if (self._running + len(start) < HOLD_WHILE_RUNNING
                        or group.end - group.offset >= COALESCE_BYTES):
                    start.append(group)
                    self._open = None
            if start and self._running == 0:
                self._busy_since = time.monotonic()
            self._running += len(start)
        for each in start:
            self._start(each)
        return future

    def _start(self, group: _Group) -> None:
        try:
            task = self._lane.submit(self._write, group)
        except BaseException:
            # no thread takes it (a closed writer): its writes will never run
            with self._backlog_lock:
                self._running -= 1
                self._backlog -= len(group.futures)
                self._pending_bytes -= group.end - group.offset
            for future in group.futures:
                future.cancel()
            raise
        task.add_done_callback(partial(self._written, group))

    def _written(self, group: _Group, task: Future[None]) -> None:
        """A group's write finished: settle its writes' futures, start a held group if the
        writes running fell below ``HOLD_WHILE_RUNNING``."""
        error = None if task.cancelled() else task.exception()
        start = None
        with self._backlog_lock:
            self._backlog -= len(group.futures)
            self._pending_bytes -= group.end - group.offset
            if error is None and not task.cancelled():
                self._written_bytes += group.end - group.offset
            self._running -= 1
            if self._open is not None and self._running < HOLD_WHILE_RUNNING and not self._closed:
                start, self._open = self._open, None
                self._running += 1
            elif self._running == 0:
                self._busy_seconds += time.monotonic() - self._busy_since
        for future in group.futures:
            if task.cancelled():
                future.cancel()
            elif error is not None:
                future.set_exception(error)
            else:
                future.set_result(None)
        if start is not None:
            with contextlib.suppress(RuntimeError):  # the writer closed meanwhile: _start cancelled it
                self._start(start)

    def _flush(self) -> None:
        """Start the held group, if any."""
        with self._backlog_lock:
            group, self._open = self._open, None
            if group is not None:
                if self._running == 0:
                    self._busy_since = time.monotonic()
                self._running += 1
        if group is not None:
            self._start(group)

    def backlog(self) -> int | None:
        """Host-buffer writes submitted and not finished (see ``StorageWriter.backlog``); None
        for buffered writes to a filesystem that takes O_DIRECT (``o_direct=False`` on a disk),
        whose completion says nothing of the disk's speed."""
        return self._backlog if self._writes_show_storage else None

    def pace(self) -> WritePace | None:
        """Pending bytes and the speed of the writes so far: bytes written over the time at
        least one write was running (None, like ``backlog``, where writes do not show the storage)."""
        if not self._writes_show_storage:
            return None
        with self._backlog_lock:
            busy = self._busy_seconds + (time.monotonic() - self._busy_since if self._running else 0.0)
            speed = self._written_bytes / busy if self._written_bytes and busy > 0 else None
            return WritePace(self._pending_bytes, speed)

    def _write(self, group: _Group) -> None:
        write = pwrite_all if len(group.buffers) == 1 else pwritev_all
        data: Any = group.buffers[0] if len(group.buffers) == 1 else group.buffers
        fd = group.fd
        try:
            write(fd, data, group.offset)
        except OSError as err:
            if fd == self._direct_fd and err.errno == errno.EINVAL:
                fd = self._fd
                write(fd, data, group.offset)  # the filesystem refused this O_DIRECT write
            else:
                raise
        if fd == self._fd and self._write_back and group.end - group.offset >= WRITEBACK_MIN_BYTES:
            start_write_back(fd, group.offset, group.end - group.offset)

    def write_tail(self, offset: int, data: bytes) -> None:
        """Write the final bytes (index and trailer) at ``offset`` synchronously and truncate the
        temporary file there."""
        pwrite_all(self._fd, data, offset)
        os.ftruncate(self._fd, offset + len(data))

    def commit(self) -> None:
        """Wait for the writes, fsync the temporary file where ``fsync`` asks (``TimeoutError``
        after ``timeout``; the target keeps its previous content) and rename it over the target,
        unless ``keep_temporary``."""
        self._flush()
        if not self._lane.drain(self.timeout):
            raise TimeoutError(f"writes to {str(self.temp)!r} still running after {self.timeout} s")
        if self.fsync:
            # on the lane, so that a storage that never completes it fails the save after
            # ``timeout`` (the previous file stays in place) instead of hanging it
            synced = self._lane.submit(os.fsync, self._fd)
            try:
                synced.result(timeout=self.timeout)
            except (TimeoutError, FutureTimeout):
                self.stalled = True  # ``abort`` leaves the descriptor to the running fsync,
                synced.add_done_callback(lambda _ended: self._close_fds())  # which closes it when it ends
                raise TimeoutError(f"the fsync of {str(self.temp)!r} did not complete within {self.timeout} s") \
                    from None
        self._lane.close(self.timeout)
        self._close_fds()
        if self.keep_temporary:
            self._closed = True
            return
        publish(self.temp, self.target, fsync=self.fsync, timeout=self.timeout)
        self._closed = True

    def abort(self) -> None:
        """Cancel the writes not started, wait (bounded) for the running ones and remove the
        temporary file; the target keeps its previous content. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        with self._backlog_lock:
            held, self._open = self._open, None
        for future in held.futures if held is not None else []:
            future.cancel()
        try:
            if self._lane.close(0.0 if self.stalled else self.timeout):
                self._close_fds()
            # else a write still running keeps its descriptor: closing it could let the number be
            # reused by another file while the write goes on.
        finally:  # also where a ^C ends the wait: a second abort returns at once
            try:
                self.temp.unlink()
            except OSError:
                pass

    def _close_fds(self) -> None:
        """Close the temporary file's descriptors, once (a stalled fsync's end and ``abort`` may
        both ask: a second close of a number could close a file opened since under it)."""
        with self._backlog_lock:
            fds, self._direct_fd, self._fd = (self._direct_fd, self._fd), None, -1
        _close_quietly(*fds)


ONE_READER_BYTES = 256 << 20
"""A file up to this size that is not in the page cache is read by one thread (``PosixReader``):
reading in order, one thread lets the kernel's readahead keep the disk busy while it copies, and
a second thread's reads at other offsets cost more than they overlap: cold loads of 64 and
256 MiB were faster on one thread, of 1 GiB on two, where the second thread pays
(docs/performance.md, "Save and load on the CPU", "One reader for a small file"). A file in the
page cache keeps ``threads``: its reads are copies, which several cores make faster."""


_mincore = _linux_libc_function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)])
"""Which pages of a mapping are resident; Linux only, where the one-reader rule was measured."""


def in_page_cache(fd: int, size: int) -> bool | None:
    """Whether the page in the middle of the open file ``fd`` is in the page cache (``mincore`` of
    a one-page mapping, which reads nothing: a load of some keys still touches no byte of the
    chunks it skips). The middle, because reading a file's header and index (its first and last
    pages) pulls their neighbours in. None where the system cannot tell."""
    page = mmap.PAGESIZE
    if _mincore is None or size < 2 * page:
        return None
    try:
        # a private mapping: writable for ctypes to take its address, never written
        mapping = mmap.mmap(fd, page, access=mmap.ACCESS_COPY, offset=size // 2 // page * page)
    except (OSError, ValueError):
        return None
    view = None
    try:
        view = ctypes.c_char.from_buffer(mapping)
        resident = ctypes.c_ubyte(0)
        failed = _mincore(ctypes.addressof(view), page, ctypes.byref(resident)) != 0
    finally:
        # The mapping cannot close while ctypes holds its buffer: drop the view first, also when
        # an exception (a ^C right after the call) leaves the block, or close would raise
        # BufferError in its place.
        view = None
        mapping.close()
    return None if failed else bool(resident.value & 1)


class PosixReader(StorageReader):
    """Positional reads into caller-provided host arrays, at most ``threads`` at once on the
    process's shared I/O threads (one for a file of at most ``ONE_READER_BYTES`` that is not in the
    page cache, read through it). ``timeout``: seconds ``close`` waits for reads still running."""

    name = "posix"

    def __init__(self, path: str | os.PathLike[str], *, threads: int = 8, timeout: float = DRAIN_TIMEOUT):
        self.path = Path(path)
        self.timeout = timeout
        self._fd = open_regular(self.path)
        try:
            self.size = os.fstat(self._fd).st_size
            # a lane starts no thread until its first read, so making it after the open costs nothing
            one_reader = self.size <= ONE_READER_BYTES and in_page_cache(self._fd, self.size) is False
            self._lane = Lane("io", 1 if one_reader else threads)
        except BaseException:  # a ^C or error before the reader exists: nothing else closes the file
            os.close(self._fd)
            raise

    def read(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset``, read synchronously; ``CorruptCheckpointError``
        where the file ends first."""
        out = np.empty(length, dtype=np.uint8)
        self._read_into(self._fd, offset, out)
        return out.tobytes()

    def file_identity(self) -> tuple[int, int] | None:
        """(device, inode) of the file this reader holds open, None once closed."""
        if self._fd < 0:
            return None
        status = os.fstat(self._fd)
        return status.st_dev, status.st_ino

    def submit_read(self, offset: int, out: np.ndarray) -> Future[np.ndarray]:
        """Read into ``out`` from ``offset`` on the reader's threads."""
        return self._lane.submit(self._read_into, self._fd, offset, out)

    def _read_into(self, fd: int, offset: int, out: np.ndarray) -> np.ndarray:
        view = out.data.cast("B")
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
        """Wait (up to ``timeout``) for running reads, then close the file; ``TimeoutError`` where a
        read still runs (the file stays open), unless the restore has already failed on it."""
        if not self._lane.close(0.0 if self.stalled else self.timeout):
            # A read still running keeps its descriptor (closing it could let the number be
            # reused by another file) and may still fill its buffer, maybe the caller's tensor.
            if self.stalled:
                return  # the restore's own error names the chunk
            raise TimeoutError(f"reads of {str(self.path)!r} still running {self.timeout} s after close")
        _close_quietly(self._fd)
        self._fd = -1
