"""kvikio / cuFile backend: writes and reads device buffers straight to and from the file.

Through GPUDirect Storage where the system has it (nvidia-fs), through kvikio's compat mode
(pinned bounce buffers and a POSIX thread pool) otherwise; ``name`` says which
(``"kvikio-gds"`` / ``"kvikio-compat"``). Host buffers and the index tail go through the POSIX
path this class inherits, as do the temporary file, fsync and atomic rename.

kvikio's thread pool and task size are process-wide: ``_KvikioSettings`` applies a reader's or
writer's ``threads`` / ``task_size`` while gdsckpt has kvikio files open and restores the previous
settings after the last one closes.

Closing: a kvikio transfer must not outlive its file handle (kvikio's contract), and a transfer
still running after a failure keeps reading into, or writing from, the pipeline's device buffers
and the handle's descriptors. So a reader or writer keeps every transfer it submitted
(``_Transfers``) and closes its handle only once all of them have finished, waiting at most its
``timeout``: a failed restore or save returns only after its reads and writes have stopped, so a
restore that follows (a manager falling back to an older checkpoint) cannot be handed memory a
stale read still fills, and a descriptor number is never reused by another file while a transfer
still uses it. A transfer that outlives the timeout keeps the handle open (``PosixReader`` and
``PosixWriter`` keep their descriptors for the same reason).

The close wait trusts that a transfer's future ends only once the transfer has stopped. kvikio
splits a call into tasks of its task size and gathers them into that future. From 26.10 it does
so only once every task has stopped, also when one failed. Releases 25.10 to 26.8 end it at the
first failed task, while the tasks after it may still be running or queued
(``parallel_operation.hpp`` of each release's libkvikio). Under those, each call gdsckpt makes is
one task (``task_size`` = its length: ``_one_task_calls``), so that its future means the same.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from .pools import DRAIN_TIMEOUT
from .posix import PosixReader, PosixWriter, in_page_cache

_SPLIT_CALLS_END_WHEN_STOPPED = (26, 10)
"""The first kvikio release whose split calls end only once every task has stopped (module
docstring)."""


def _one_task_calls() -> bool:
    """Whether the installed kvikio ends a split call at its first failed task (before 26.10), so
    that each of gdsckpt's calls must be one task; True too where the version cannot be read."""
    import kvikio

    found = re.match(r"(\d+)\.(\d+)", str(getattr(kvikio, "__version__", "")))
    return found is None or (int(found.group(1)), int(found.group(2))) < _SPLIT_CALLS_END_WHEN_STOPPED


_POLL_SECONDS = 0.0005
"""How often a ``result(timeout=...)`` looks at an unfinished kvikio transfer (a 16 MiB chunk
takes ~8 ms at 2 GB/s: the poll adds at most a few percent of latency to the wait). A thread
polling like this beside a training loop did not slow it (31.3 ms per step against 31.4 idle)."""



class _KvikioFuture(Future):  # type: ignore[type-arg]
    """A ``concurrent.futures.Future`` view of a kvikio ``IOFuture`` (polled; kvikio has no callbacks)."""

    def __init__(self, io_future: Any, expected: int, what: str, value: Any = None):
        super().__init__()
        self._io, self._expected, self._what, self._value = io_future, expected, what, value
        self._got = False
        """Whether ``get()`` returned or raised: kvikio's future is invalid after it (its
        ``done()`` raises), so nothing asks it again."""
        self._io_lock = threading.Lock()
        """kvikio's future wraps a ``std::future``, which two threads must not use at once (the
        reader's ``close`` may ask while the restore driver settles)."""
        self.on_finished: Callable[[_KvikioFuture], None] | None = None
        """Called once the transfer is known to have finished (settled, or cancelled after it):
        ``_Transfers`` then forgets it at once, so that the buffer this future holds goes with its
        caller's last reference. Kept until the next transfer came, a lead read's pieces (closed
        because the restore's budget cannot hold them beside its ring) stayed allocated while the
        ring and read arena were allocated beside them."""

    def transfer_done(self) -> bool:
        """Whether kvikio's transfer has finished (whatever this future says: a cancelled future's
        transfer may still be running)."""
        with self._io_lock:
            return self._got or bool(self._io.done())

    def cancel(self) -> bool:
        """kvikio cannot stop a transfer: False while it runs, as for a running future (its
        reader or writer waits for it before closing the file)."""
        with self._io_lock:
            if not self._got:
                if not self._io.done():
                    return False
                self._got = True
                with contextlib.suppress(Exception):  # cancelled: its outcome no longer matters
                    self._io.get()  # finished, so at once; nothing asks kvikio again
        self._finished()
        return super().cancel()

    def _finished(self) -> None:
        """Tell ``on_finished`` (outside ``_io_lock``: ``_Transfers`` asks futures under its own
        lock) once the transfer is over."""
        if self._got and self.on_finished is not None:
            self.on_finished(self)

    def done(self) -> bool:
        if not super().done() and self.transfer_done():
            self._settle()
        return super().done()

    def result(self, timeout: float | None = None) -> Any:
        if not super().done():
            if timeout is not None:
                # kvikio's get() cannot time out: poll (it releases the GIL meanwhile) so that a
                # hung transfer fails the operation after ``timeout`` instead of blocking forever.
                if not _poll(self.transfer_done, timeout):
                    raise TimeoutError(f"kvikio {self._what} of {self._expected} bytes still running "
                                       f"after {timeout} s")
            self._settle()
        return super().result(timeout)

    def _settle(self) -> None:
        try:
            with self._io_lock:
                if self._got:
                    return  # settled by another thread, or cancelled once its transfer had finished
                try:
                    count = self._io.get()
                finally:
                    self._got = True
            if count != self._expected:
                raise OSError(f"kvikio {self._what} moved {count} of {self._expected} bytes")
            self.set_result(self._value)
        except RuntimeError as err:
            self.set_exception(kvikio_error(err, self._what, self._expected))
        except BaseException as err:  # noqa: BLE001 - delivered through the future
            self.set_exception(err)
        finally:
            self._finished()


class _Transfers:
    """The kvikio transfers a reader or writer submitted that may still run (see the module
    docstring). A future is forgotten as soon as its transfer is seen finished (its
    ``on_finished``), and finished ones whose futures nobody settles are dropped from the front as
    new ones come (transfers finish roughly in submission order), so the list stays about as long
    as the transfers in flight and holds no finished transfer's buffer."""

    def __init__(self) -> None:
        self._pending: deque[_KvikioFuture] = deque()
        self._lock = threading.Lock()

    def add(self, future: _KvikioFuture) -> _KvikioFuture:
        """Track ``future``'s transfer; returns ``future``."""
        future.on_finished = self.forget
        with self._lock:
            self._drop_finished()
            self._pending.append(future)
        return future

    def forget(self, future: _KvikioFuture) -> None:
        """Stop tracking ``future``, whose transfer has finished (its ``on_finished``)."""
        with self._lock, contextlib.suppress(ValueError):
            self._pending.remove(future)

    def wait(self, timeout: float) -> bool:
        """Wait until every tracked transfer has finished, at most ``timeout`` seconds; True when
        they all have (they are then forgotten)."""
        def finished() -> bool:
            with self._lock:  # taken per poll: a settling future's ``forget`` never waits out the timeout
                return self._drop_finished()
        return _poll(finished, timeout)

    def _drop_finished(self) -> bool:
        """Forget the finished transfers at the front (under ``_lock``); True when none is left."""
        pending = self._pending
        while pending and pending[0].transfer_done():
            pending.popleft()
        return not pending


def _poll(finished: Callable[[], bool], timeout: float) -> bool:
    """Ask ``finished`` every ``_POLL_SECONDS`` until it says True (True) or ``timeout`` seconds
    have passed (False): kvikio's futures have no callbacks and their ``get`` no timeout."""
    deadline = time.monotonic() + timeout
    while not finished():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_SECONDS)
    return True


def _task_size(whole: bool, nbytes: int, fixed: int | None = None) -> tuple[int, ...]:
    """The ``task_size`` argument of a kvikio call of ``nbytes``: the whole call as one task where
    ``whole`` (``_one_task_calls``), else ``fixed`` where given (a writer's or a cold reader's own
    task size), else none (kvikio's task size)."""
    if whole:
        return (max(nbytes, 1),)
    return () if fixed is None else (fixed,)


_KVIKIO_POSIX = re.compile(r"POSIX error on p(?:read|write):\s*(.*)")
_BY_STRERROR = {os.strerror(code): code for code in errno.errorcode}


def kvikio_error(err: RuntimeError, what: str, nbytes: int) -> BaseException:
    """kvikio reports a failed transfer as a bare ``RuntimeError`` ("KvikIO failure at ...: POSIX
    error on pread: EIO"), measured with kvikio in compat mode: turn it into what the POSIX path raises, so
    the pipeline names the chunk and tensor and the manager treats it as damage: an ``OSError``
    with the errno kvikio names (EIO when it names none), or ``CorruptCheckpointError`` when a
    read hit the end of the file (a file truncated after its index was read)."""
    message = str(err)
    match = _KVIKIO_POSIX.search(message)
    detail = match.group(1).strip() if match else ""
    if detail.startswith("EOF"):
        from ..errors import CorruptCheckpointError

        return CorruptCheckpointError(f"file ends inside a {nbytes}-byte {what} the index names ({message})")
    # kvikio names the error by its text ("File too large") or, in some versions, its symbol.
    code = next((c for text, c in _BY_STRERROR.items() if detail.startswith(text)), None)
    if code is None:
        symbol = getattr(errno, detail.split(" ")[0], None) if detail else None
        code = symbol if isinstance(symbol, int) else errno.EIO
    error = OSError(code, f"{os.strerror(code)} (kvikio {what} of {nbytes} bytes: {message})")
    error.__cause__ = err
    return error


class _KvikioSettings:
    """kvikio's process-wide settings (``thread_pool_nthreads``, ``task_size``), scoped to the
    files gdsckpt has open.

    kvikio has one thread pool per process. The first of our readers or writers to open sets the
    pool to its ``threads`` (and ``task_size``); the settings in force before are restored when
    the last of them closes, so a caller's own kvikio configuration is left as it was found.
    While any of our files is open the settings are not changed again: resizing kvikio's pool
    replaces it, under the transfers of the files already open (a background save overlapping a
    load); a later file with other settings shares the ones in force."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved: dict[str, Any] = {}

    def acquire(self, threads: int, task_size: int | None) -> None:
        """Count one open file; the first one applies its settings."""
        import kvikio.defaults

        with self._lock:
            if self._users == 0:
                wanted: dict[str, Any] = {"thread_pool_nthreads": threads}
                if task_size is not None:
                    wanted["task_size"] = task_size
                saved = {}
                for key, value in wanted.items():
                    current = kvikio.defaults.get(key)
                    if current != value:
                        saved[key] = current
                        kvikio.defaults.set(key, value)
                self._saved = saved
            self._users += 1

    def release(self) -> None:
        """Count one file closed; the last one restores the settings found by the first."""
        import kvikio.defaults

        with self._lock:
            self._users -= 1
            if self._users == 0:
                saved, self._saved = self._saved, {}
                for key, value in saved.items():
                    kvikio.defaults.set(key, value)


_SETTINGS = _KvikioSettings()


def kvikio_mode() -> str:
    """``"gds"`` when kvikio will use GPUDirect Storage, else ``"compat"``."""
    import kvikio.defaults

    return "compat" if kvikio.defaults.is_compat_mode_preferred() else "gds"


WRITE_TASK_BYTES: int | None = 8 << 20
"""kvikio's task size for device-buffer writes in compat mode where no ``task_size`` is
configured (``KvikioWriter``; each call's own, kvikio's process-wide setting left alone). Why:
GPU saves of a trained state to /dev/shm came nearer ratio x the raw kvikio write with 8 or
16 MiB tasks than with kvikio's default 4 MiB ones, in every run that timed them
(docs/performance.md, "Fast tiers"). None: kvikio's task size. Through GPUDirect Storage
kvikio's task size stays."""


class KvikioWriter(PosixWriter):
    """``PosixWriter`` whose device-buffer writes go through ``kvikio.CuFile.pwrite``, in tasks of
    ``task_size`` (None: ``WRITE_TASK_BYTES`` in compat mode, kvikio's own through GPUDirect
    Storage); ``write_task_bytes`` says which (None: kvikio's task size)."""

    def __init__(self, target: str | os.PathLike[str], *, threads: int = 16, task_size: int | None = None,
                 o_direct: bool | str = "auto", fsync: bool = True, timeout: float = DRAIN_TIMEOUT):
        import kvikio

        super().__init__(target, threads=threads, o_direct=o_direct, fsync=fsync, timeout=timeout)
        self._transfers = _Transfers()
        self._settings_held = False
        try:
            _SETTINGS.acquire(threads, task_size)
            self._settings_held = True
            self._cufile = kvikio.CuFile(self.temp, "r+")
        except BaseException:
            self.abort()
            raise
        self.name = f"kvikio-{kvikio_mode()}"
        self._one_task_each = _one_task_calls()
        self.write_task_bytes = WRITE_TASK_BYTES if task_size is None and self.name == "kvikio-compat" else None

    def backlog(self) -> int | None:
        """None: device-buffer writes run in kvikio's pool, which does not say what it holds."""
        return None

    def submit_write(self, offset: int, data: Any) -> Future[None]:
        """A host buffer as ``PosixWriter`` writes it; a device buffer through ``CuFile.pwrite`` in
        tasks of ``write_task_bytes`` (a kvikio failure raised as gdsckpt's storage error)."""
        if isinstance(data, (np.ndarray, bytes, bytearray, memoryview)):
            return super().submit_write(offset, data)
        tasks = _task_size(self._one_task_each, data.nbytes, self.write_task_bytes)
        try:
            io_future = self._cufile.pwrite(data, data.nbytes, offset, *tasks)
        except RuntimeError as err:
            raise kvikio_error(err, "write", data.nbytes) from err
        return self._transfers.add(_KvikioFuture(io_future, data.nbytes, "write"))

    def commit(self) -> None:
        """Close the kvikio file once its writes have finished, then commit as ``PosixWriter``
        does (``TimeoutError`` where a write is still running after ``timeout``: nothing is
        committed)."""
        if not self._transfers.wait(self.timeout):
            raise TimeoutError(f"kvikio writes of {str(self.target)!r} still running {self.timeout} s "
                               f"before the commit")
        self._cufile.close()
        self._release_settings()
        super().commit()

    def abort(self) -> None:
        """Close the kvikio file once its writes have stopped (at most ``timeout``; a write still
        running then keeps it open), then abort as ``PosixWriter`` does (safe more than once)."""
        cufile = getattr(self, "_cufile", None)
        transfers = getattr(self, "_transfers", None)
        stopped = transfers is None or transfers.wait(0.0 if self.stalled else self.timeout)
        if cufile is not None and not cufile.closed and stopped:
            cufile.close()
        if stopped:  # else the pool keeps its size: restoring the settings would replace it under the write
            self._release_settings()
        super().abort()

    def _release_settings(self) -> None:
        if getattr(self, "_settings_held", False):
            self._settings_held = False
            _SETTINGS.release()


COLD_READ_TASK_BYTES: int | None = 16 << 20
"""kvikio's task size for the device reads of a file whose data is not in the page cache, in
compat mode, where no ``task_size`` is configured (``KvikioReader``). Why: larger POSIX reads keep
more of a cold storage's queue busy. A kvikio read of an 8.9 GB file not in the page cache into
device memory ran 13-14% faster in 16 MiB tasks than in kvikio's default 4 MiB ones, and the
restores matched the default-task read; from the page cache, 16 MiB tasks were 5-8% slower
(docs/performance.md, "Cold reads"). None: kvikio's task size for every read."""


class KvikioReader(PosixReader):
    """``PosixReader`` that reads into device buffers with ``kvikio.CuFile.pread``.

    Where ``task_size`` is None and kvikio runs in compat mode, a file whose middle page is not in
    the page cache when it is opened (``in_page_cache``) is read in tasks of
    ``COLD_READ_TASK_BYTES``, each call's own (kvikio's process-wide setting is left alone);
    ``read_task_bytes`` says which (None: kvikio's task size). Through GPUDirect Storage the page
    cache plays no part, and kvikio's task size stays."""

    def __init__(self, path: str | os.PathLike[str], *, threads: int = 16, task_size: int | None = None,
                 timeout: float = DRAIN_TIMEOUT):
        import kvikio

        super().__init__(path, threads=threads, timeout=timeout)
        self._transfers = _Transfers()
        self._settings_held = False
        try:
            _SETTINGS.acquire(threads, task_size)
            self._settings_held = True
            self._cufile = kvikio.CuFile(self.path, "r")
        except BaseException:
            self.close()
            raise
        self.name = f"kvikio-{kvikio_mode()}"
        self._one_task_each = _one_task_calls()
        self.read_task_bytes: int | None = None
        if (task_size is None and COLD_READ_TASK_BYTES is not None and self.name == "kvikio-compat"
                and in_page_cache(self._fd, self.size) is False):
            self.read_task_bytes = COLD_READ_TASK_BYTES

    def submit_read(self, offset: int, out: Any) -> Future[Any]:
        """Into a host array as ``PosixReader`` reads; into a device buffer through ``CuFile.pread``
        in tasks of ``read_task_bytes`` (``CorruptCheckpointError`` for a range past the file's
        end)."""
        if isinstance(out, np.ndarray):
            return super().submit_read(offset, out)
        if offset + out.nbytes > self.size:
            from ..errors import CorruptCheckpointError

            raise CorruptCheckpointError(f"range [{offset}, +{out.nbytes}) runs past the end of the file")
        tasks = _task_size(self._one_task_each, out.nbytes, self.read_task_bytes)
        try:
            io_future = self._cufile.pread(out, out.nbytes, offset, *tasks)
        except RuntimeError as err:
            raise kvikio_error(err, "read", out.nbytes) from err
        return self._transfers.add(_KvikioFuture(io_future, out.nbytes, "read", out))

    def close(self) -> None:
        """Close the kvikio file once its reads have stopped, then the POSIX one (safe more than
        once). ``TimeoutError`` where a read is still running after ``timeout``: the file stays
        open, as the read may still fill its buffer."""
        cufile = getattr(self, "_cufile", None)
        if cufile is not None and not cufile.closed:
            if not self._transfers.wait(0.0 if self.stalled else self.timeout):
                if self.stalled:
                    return  # the restore's own error names the chunk; the file stays open
                raise TimeoutError(f"kvikio reads of {str(self.path)!r} still running {self.timeout} s "
                                   f"after close")
            cufile.close()
        if self._settings_held:
            self._settings_held = False
            _SETTINGS.release()
        super().close()
