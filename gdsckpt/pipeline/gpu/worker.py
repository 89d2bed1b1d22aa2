"""The worker thread of a GPU encoder or decoder: takes queued jobs in batches and runs them.

One thread per encoder or decoder, started at the first job. It makes the device current before
touching it, then repeatedly takes whatever jobs are queued, up to ``batch_size``, and hands them
to the owner's batch function. An exception from that function reaches every job of the batch
whose future is not done yet. Every wait is bounded: the idle wait for work polls so that
``close`` is noticed, and ``close`` waits at most ``timeout`` for the thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

BATCH_CHUNKS = 256
"""Most chunks a worker hands nvCOMP in one batch (fewer when fewer are queued or the ring has
fewer slots). A batch call costs nearly the same whatever it holds, and two batches on two
streams at once were no faster than one (``experiments/batch_scaling.py``; figures in
docs/performance.md, "Fast tiers")."""
IDLE_POLL_SECONDS = 1.0
"""How long the idle worker waits for a job before looking whether it was closed."""


class Job(Protocol):
    """A unit of work: whatever the owner queues, with the future its result goes to."""

    future: Future[Any]


class BatchWorker:
    """A thread running ``run_batch(jobs)`` on batches of submitted jobs (module docstring)."""

    def __init__(self, name: str, use_device: Callable[[], None], run_batch: Callable[[list[Any]], None], *,
                 batch_size: int, timeout: float):
        self._name = name
        self._use_device = use_device
        self._run_batch = run_batch
        self._batch_size = max(1, batch_size)
        self._timeout = timeout
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closing = False

    def submit(self, job: Job) -> None:
        """Queue ``job``, starting the thread on first use."""
        with self._lock:
            if self._closing:
                raise RuntimeError(f"{self._name} is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._jobs.put(job)

    def close(self, wait: bool = True) -> bool:
        """Let the queued jobs finish, stop the thread (waiting at most ``timeout``, not at all
        without ``wait``); True when it has stopped (or never started)."""
        with self._lock:
            self._closing = True
            thread = self._thread
        if thread is None:
            return True
        self._jobs.put(None)
        thread.join(timeout=self._timeout if wait else 0.0)
        return not thread.is_alive()

    def _next(self) -> Any:
        """The next job, or None once closed (polling: no wait without a timeout)."""
        while True:
            try:
                return self._jobs.get(timeout=IDLE_POLL_SECONDS)
            except queue.Empty:
                if self._closing:
                    return None

    def _run(self) -> None:
        failed: BaseException | None = None
        try:
            self._use_device()  # a new thread has no current device
        except BaseException as err:  # noqa: BLE001 - every job then fails with it
            failed = err
        while True:
            job = self._next()
            if job is None:
                return
            batch = [job]
            while len(batch) < self._batch_size:
                try:
                    extra = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if extra is None:
                    self._jobs.put(None)
                    break
                batch.append(extra)
            try:
                if failed is not None:
                    raise failed
                self._run_batch(batch)
            except BaseException as err:  # noqa: BLE001 - delivered to every waiting future
                for each in batch:
                    if not each.future.done():
                        each.future.set_exception(err)
            # An idle worker must not keep its last batch: its jobs hold views of the staging it
            # read (a decoder's ring and arena), which would stay allocated beside the next
            # restore's until the next batch came (pools.WorkerPool drops its last task too).
            job = extra = each = None
            batch = []



class WorkerOwner:
    """What the GPU encoder and decoder share: a device backend (``device``), a ``BatchWorker``
    (``_worker``) and a staging ring (``ring``, None until allocated), and how they close."""

    device: Any
    ring: Any
    _worker: BatchWorker
    _closed: bool = False
    stalled: bool = False
    """``Encoder.stalled`` / ``Decoder.stalled``: a driver's wait on the worker timed out."""

    def close(self) -> None:
        """Stop the worker (bounded by its timeout), then release the codecs and the ring: codecs
        are destroyed when the worker stopped (before the stream they run on), merely dropped
        when it is still running, since it may be inside one of them."""
        if self._closed:
            return
        self._closed = True
        if self._worker.close(wait=not self.stalled):
            self.device.close()
        else:
            self.device.forget_codecs()
        if self.ring is not None:
            self.ring.close()
