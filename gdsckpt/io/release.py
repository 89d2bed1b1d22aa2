"""Freeing the storage of a replaced or removed checkpoint off the caller's path.

A file's storage is freed when its last name and its last open descriptor are gone, inside the
system call that drops them: the ``rename`` of a save over the previous checkpoint at the same
path, or the ``unlink`` with which ``CheckpointManager`` prunes an old one. That is not free: on
tmpfs every page is released one by one, and on a filesystem mounted with ``discard`` the freed
blocks are discarded too; a save that replaced a checkpoint of several GiB paid for it before
returning (docs/performance.md, "Replacing a checkpoint").

So for a large file (``RELEASE_MIN_BYTES``) the caller first opens it (``Releaser.hold``), then
renames over it or unlinks it (the name goes at once: readers and the next save see the new
state), and hands the descriptor to ``Releaser.release``: a daemon thread closes it, and the
kernel frees the storage there. At most ``MAX_PENDING`` descriptors wait; beyond that the caller
closes its own, paying what it would have paid anyway, so the storage held back stays bounded
(two replaced checkpoints). A process that exits first has its descriptors closed, and the storage
freed, by the kernel at exit. Small files (a pointer, metadata) are renamed and removed as
before: their freeing costs less than the hand-off.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

RELEASE_MIN_BYTES = 64 << 20
"""Files at least this large are released in the background."""
MAX_PENDING = 2
"""Descriptors waiting to be closed at most; another one is closed by its caller."""
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO at the path must not stall the open
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class Releaser:
    """Closes the descriptors of replaced or removed files on one daemon thread (module
    docstring). ``close`` is the function that closes one (``os.close``)."""

    def __init__(self, close: Callable[[int], None] = os.close):
        self._close = close
        self._condition = threading.Condition()
        self._queue: deque[int] = deque()
        self._pending = 0
        """Descriptors queued or being closed."""
        self._thread: threading.Thread | None = None

    def hold(self, path: str | os.PathLike[str], *, min_bytes: int | None = None) -> int | None:
        """A read-only descriptor of ``path`` that keeps its storage alive once its name is
        replaced or removed, or None where there is nothing worth deferring: no such file, not a
        regular file (a symlink itself is replaced, not what it names), a file with other hard
        links (its storage stays with them), or one smaller than ``min_bytes``
        (``RELEASE_MIN_BYTES``)."""
        try:
            fd = os.open(path, os.O_RDONLY | _NONBLOCK | _NOFOLLOW | _CLOEXEC)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
        except OSError:
            os.close(fd)
            return None
        smallest = RELEASE_MIN_BYTES if min_bytes is None else min_bytes
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_size < smallest:
            os.close(fd)
            return None
        return fd

    def release(self, fd: int | None) -> None:
        """Close ``fd`` (from ``hold``; None: nothing) on the releaser's thread, or here when
        ``MAX_PENDING`` already wait."""
        if fd is None:
            return
        with self._condition:
            queued = self._pending < MAX_PENDING
            if queued:
                self._pending += 1
                self._queue.append(fd)
                self._condition.notify_all()
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="gdsckpt-release", daemon=True)
                    try:
                        self._thread.start()
                    except RuntimeError:  # no thread to be had: close it here after all
                        self._thread = None
                        self._queue.remove(fd)
                        self._pending -= 1
                        queued = False
        if not queued:
            with contextlib.suppress(OSError):
                self._close(fd)

    def pending(self) -> int:
        """Descriptors queued or being closed."""
        with self._condition:
            return self._pending

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every released descriptor is closed; False if ``timeout`` passed first."""
        with self._condition:
            return self._condition.wait_for(lambda: self._pending == 0, timeout)

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: bool(self._queue))
                fd = self._queue.popleft()
            try:
                self._close(fd)
            except OSError:
                pass
            finally:
                with self._condition:
                    self._pending -= 1
                    self._condition.notify_all()

    def after_fork_in_child(self) -> None:
        """The child of a fork has no releaser thread: close the descriptors it inherited queued
        (its copies; the parent's stay) and start afresh."""
        self._condition = threading.Condition()
        queued, self._queue = self._queue, deque()
        self._pending, self._thread = 0, None
        for fd in queued:
            with contextlib.suppress(OSError):
                os.close(fd)


RELEASER = Releaser()
"""The process's releaser (``publish`` and ``remove_releasing`` use it)."""
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: RELEASER.after_fork_in_child())


def remove_releasing(path: str | os.PathLike[str], releaser: Any = None) -> None:
    """Remove ``path`` (``FileNotFoundError`` if it does not exist), freeing a large file's
    storage in the background (module docstring)."""
    releaser = releaser or RELEASER
    held = releaser.hold(path)
    try:
        os.unlink(path)
    except BaseException:
        if held is not None:
            os.close(held)
        raise
    releaser.release(held)
