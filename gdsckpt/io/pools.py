"""Process-wide worker threads, started once and reused by every save, load and verify.

Why not a ``ThreadPoolExecutor`` per operation: starting threads in every save fails under a
tight address-space limit (``RLIMIT_AS``, ``ulimit -v``), and can hang. CPython's
``Thread.start`` waits without a bound for the new thread to say it runs; a thread whose stack
glibc hands out from its cache of exited threads' stacks, but which cannot map its first Python
frame, dies of a ``MemoryError`` before it says so, and ``start`` never returns (Python 3.11: the
second save of a process limited to the address space it had after the first blocked forever).
So each pool starts its threads through ``_thread.start_new_thread`` with a handshake bounded by
``START_TIMEOUT``, and keeps them for the life of the process.

Each user (an engine, a writer, a reader) takes a ``Lane`` of a pool: a FIFO queue of its own
with at most ``threads`` of its tasks running at once, the bound its own executor used to give
it. A pool holds at least as many threads as its busy lanes together may run, so a lane never
waits for a thread held by another: a delta save's codec task restores its base through lanes
of the same pools and waits for them. Pools grow when busy lanes need more threads and never
shrink; a child process made by ``fork`` starts with none (the parent's threads do not exist in
it) and lanes made before the fork move to the child's pools on their next submit.
"""

from __future__ import annotations

import _thread
import functools
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

START_TIMEOUT = 30.0
"""Seconds a new worker thread may take to report that it runs before the operation that needed
it fails with ``RuntimeError`` (a healthy thread reports within a millisecond)."""
DRAIN_TIMEOUT = 600.0
"""Default seconds ``Lane.close`` waits for its running tasks (``Config.timeout``'s default)."""


RECHECK_SECONDS = 0.5
"""The longest a ``Gate`` waiter sleeps before it checks again without being woken."""


def refuse_reentry(lock: Any, what: str) -> None:
    """``RuntimeError`` where the calling thread holds ``lock`` already (an ``RLock``; a lock
    that cannot tell is not checked): it is inside ``what`` and a signal handler that ran there
    (SIGTERM, SIGUSR1 on a pre-emption) called gdsckpt again. Taking the lock would wait for
    the frame the handler interrupted, which can only go on once the handler returns: for ever.
    ``RLock._is_owned`` is C code, and so is taking the lock with ``with`` (``Gate``): wherever
    the handler lands, the lock is either held already (refused here) or free."""
    is_owned = getattr(lock, "_is_owned", None)
    if is_owned is not None and is_owned():
        raise RuntimeError(reentry_message(what))


def reentry_message(what: str) -> str:
    """What a call that re-entered ``what`` from its own thread is told (``refuse_reentry``)."""
    return (f"gdsckpt was called while this thread was inside {what}: a signal handler that "
            f"interrupted it and calls gdsckpt would wait for the call it interrupted, for ever. In the "
            f"handler, set a flag and save from the training loop when it sees the flag "
            f"(docs/quickstart.md, \"Pre-emption\")")


class Gate:
    """Bookkeeping under a lock, and waits for it to change that a ^C cannot break.

    Why not ``threading.Condition``: it runs Python code while it holds its lock, gives it up, or
    takes it back (``__exit__``, ``wait``), and the main thread runs a ^C's handler where CPython
    checks for signals: at the start of any Python function and on the return from a C call,
    which that code is full of. A ^C landing there leaves the lock held (so every other thread using it
    blocks for ever: the background save's end, a later save's place) or released twice. Here
    the lock is a ``threading.RLock`` (or the caller's ``Lock``) taken only by ``with`` (C code
    both ways), and a
    waiter sleeps outside it on a queue of its own (``SimpleQueue.get``, C code): wherever a ^C
    lands, the lock is free afterwards and the bookkeeping is as its last statement left it. A
    waiter that missed its wake-up (a ^C inside the notifier's loop) checks again after
    ``RECHECK_SECONDS``. A signal handler that calls gdsckpt where this thread holds the lock
    (inside ``ready`` or ``then``) is refused (``refuse_reentry``) rather than left waiting for
    itself.
    """

    def __init__(self, lock: Any = None, what: str = "a wait of gdsckpt's"):
        self.lock = lock if lock is not None else threading.RLock()
        """Guards the bookkeeping; take it with ``with`` only. An ``RLock`` by default: only so
        that ``wait_for`` can tell a signal handler re-entering it (``refuse_reentry``), never
        to take it twice."""
        self.what = what
        """What the bookkeeping belongs to, for ``refuse_reentry``'s message."""
        self._wakers: list[queue.SimpleQueue[None]] = []

    @property
    def waiting(self) -> int:
        """Threads waiting in ``wait_for`` now."""
        with self.lock:
            return len(self._wakers)

    def wait_for(self, ready: Callable[[], bool], timeout: float | None,
                 then: Callable[[], None] | None = None) -> bool:
        """Wait until ``ready()`` is true, then run ``then()`` (both under ``lock``, which the
        caller must not hold); False if ``timeout`` seconds (None: no bound) pass first.
        ``RuntimeError`` where this thread holds ``lock`` (``refuse_reentry``)."""
        refuse_reentry(self.lock, self.what)
        deadline = None if timeout is None else time.monotonic() + timeout
        waker: queue.SimpleQueue[None] = queue.SimpleQueue()
        try:
            while True:
                with self.lock:
                    if ready():
                        if then is not None:
                            then()
                        return True
                    if waker not in self._wakers:
                        self._wakers.append(waker)
                remaining = RECHECK_SECONDS if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return False
                try:
                    waker.get(timeout=min(remaining, RECHECK_SECONDS))
                except queue.Empty:
                    pass
        finally:
            with self.lock:
                if waker in self._wakers:
                    self._wakers.remove(waker)

    def notify_all(self) -> None:
        """Wake every waiter; call it holding ``lock``, after changing what they wait for."""
        for waker in self._wakers:
            waker.put(None)


class WorkerPool:
    """Daemon threads that run whatever ``Lane``s hand them; see the module docstring."""

    def __init__(self, name: str):
        self.name = name
        self.tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        """The tasks for the next idle worker (callers stay within their reservation). A plain
        attribute: ``Lane.submit`` puts into it with no Python frame in between (``put`` is C
        code), where a ^C could land."""
        self._lock = threading.Lock()
        self._threads = 0
        self._reserved = 0

    def reserve(self, threads: int) -> None:
        """Make room for a busy lane of ``threads`` tasks, starting threads until every busy
        lane's tasks can run at once. Raises ``RuntimeError`` (nothing reserved) if a thread
        cannot be started."""
        with self._lock:
            self._reserved += threads
            try:
                while self._threads < self._reserved:
                    self._start_worker()
                    self._threads += 1
            except BaseException:
                self._reserved -= threads
                raise

    def release(self, threads: int) -> None:
        """Give back a lane's reservation when it goes idle; the threads stay for the next."""
        with self._lock:
            self._reserved -= threads

    def _start_worker(self) -> None:
        started = threading.Event()
        abandoned = threading.Event()

        def run() -> None:
            started.set()
            if not abandoned.is_set():  # one that starts after the caller gave up on it just ends
                self._work()

        name = f"gdsckpt-{self.name} worker {self._threads + 1}"
        try:
            _thread.start_new_thread(run, ())
        except (RuntimeError, MemoryError) as err:
            raise RuntimeError(f"cannot start {name} ({err}); the process may be short of address "
                               f"space (ulimit -v) or of threads (ulimit -u)") from err
        if not started.wait(START_TIMEOUT):
            abandoned.set()
            raise RuntimeError(f"{name} did not start within {START_TIMEOUT} s; the process may be "
                               f"short of address space (ulimit -v) for a thread's stack")

    def _work(self) -> None:
        _WORKER.inside = True
        while True:
            # An idle worker waits for work as long as the process lives: this wait holds up no
            # operation (each lane's caller bounds its own waits on its futures).
            task = self.tasks.get()
            try:
                task()
            except BaseException:  # noqa: BLE001
                # A lane delivers its tasks' errors through their futures; this only keeps the
                # worker (which the pool counts on) alive should that bookkeeping itself fail.
                pass
            # An idle worker must not keep its last task: the task holds its arguments and its
            # future (a read's buffer, a chunk's bytes), which would stay allocated, outside every
            # memory bound, until this thread's next task.
            del task


_WORKER = threading.local()
"""``inside`` is True on the pools' worker threads."""


def on_a_worker_thread() -> bool:
    """Whether the calling thread is one of the pools' workers (which must not wait for a lane's
    tasks to end: it may be running one of them)."""
    return bool(getattr(_WORKER, "inside", False))


_POOLS: dict[str, WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(name: str) -> WorkerPool:
    """The process's pool called ``name`` (``"codec"``, ``"io"``), created on first use."""
    with _POOLS_LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            pool = _POOLS[name] = WorkerPool(name)
        return pool


def _forget_pools_after_fork() -> None:
    # The child has only the forking thread: the parent's workers, and any lock one of its
    # threads held at the fork, must not be waited for there.
    global _POOLS_LOCK
    _POOLS_LOCK = threading.Lock()
    _POOLS.clear()


os.register_at_fork(after_in_child=_forget_pools_after_fork)


class Lane:
    """Runs its tasks on the shared pool ``pool_name`` in submission order, at most ``threads``
    at once. ``submit`` never waits for a task; ``close`` cancels what has not started and
    waits, bounded, for what has.

    While it has tasks, a lane reserves ``threads`` threads of its pool (the first ``submit`` of
    a burst may start them and raise ``RuntimeError``); an idle lane holds none, so an open but
    idle reader costs no thread."""

    def __init__(self, pool_name: str, threads: int):
        self.pool_name = pool_name
        self.threads = max(1, threads)
        self._lock = threading.Lock()
        self._idle = Gate(self._lock)
        self._pending: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = deque()
        self._running = 0
        self._pool: WorkerPool | None = None
        """The pool reserved from while tasks run; None while idle."""
        self._pid = os.getpid()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on the pool; its result or exception arrives through the future."""
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"submit to a closed {self.pool_name} lane")
            if self._pid != os.getpid():
                # Made before a fork: the tasks counted here belong to the parent's threads.
                self._pid, self._pool, self._running = os.getpid(), None, 0
                self._pending.clear()
            if self._pool is None:
                pool = shared_pool(self.pool_name)
                pool.reserve(self.threads)
                self._pool = pool
            if self._running < self.threads:
                # Counted, then queued with the queue's own put (C code, never blocking), with no
                # call between them where a ^C could be handled: it lands before both or after
                # both. One between them left a task counted that never ran, or queued and
                # uncounted, and the lane's close waited its whole timeout for the count to be 0.
                task = functools.partial(self._run, future, fn, args)
                tasks = self._pool.tasks
                self._running += 1
                tasks.put(task)
            else:
                self._pending.append((future, fn, args))
        return future

    def _run(self, future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        # One worker runs the lane's next pending task when it finishes one, so the lane's tasks
        # start in submission order (a codec task may wait for an earlier one's decision).
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as err:  # noqa: BLE001 - delivered through the future
                    future.set_exception(err)
            with self._lock:
                if not self._pending:
                    self._running -= 1
                    if self._running == 0 and self._pool is not None:
                        self._pool.release(self.threads)
                        self._pool = None
                        self._idle.notify_all()
                    return
                future, fn, args = self._pending.popleft()

    def drain(self, timeout: float | None = DRAIN_TIMEOUT) -> bool:
        """Wait up to ``timeout`` s for every task submitted so far to end, leaving the lane open;
        True when none runs any more."""
        return self._idle.wait_for(lambda: self._running == 0, timeout)

    def close(self, timeout: float | None = DRAIN_TIMEOUT) -> bool:
        """Cancel the tasks not started and wait up to ``timeout`` s for the running ones; True
        when none runs any more."""
        with self._lock:
            self._closed = True
            for future, _fn, _args in self._pending:
                future.cancel()
            self._pending.clear()
        return self._idle.wait_for(lambda: self._running == 0, timeout)
