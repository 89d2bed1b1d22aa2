"""Asynchronous saves: ``save_async`` returns once a consistent snapshot of the state exists and
writes it (``gdsckpt.save``) from a background thread, so training continues during the write.

How it works
------------
1. The structure is validated exactly as ``gdsckpt.save`` validates it (an unsupported value
   raises ``TypeError`` in the caller, before anything starts).
2. Every tensor / array is copied into *snapshot buffers* from a pool (``SnapshotPool``) that
   keeps its buffers between saves, keyed by size: a training loop that saves the same state
   again and again allocates its snapshot memory once. CPU torch tensors and NumPy arrays are
   copied into plain host buffers. CUDA torch tensors are copied on their GPU when their bytes
   fit in ``Config.snapshot_gpu_bytes`` (device-to-device, terabytes per second: milliseconds),
   otherwise into pinned host buffers (~50 GB/s); both with ``non_blocking`` copies and one
   ``torch.cuda.synchronize`` per device. Containers and plain
   values are rebuilt (OrderedDict ``_metadata`` included); tensors that are the same view (tied
   weights) share one snapshot, so the file stores them once as ``gdsckpt.save`` would.
   JAX arrays are immutable and kept as they are; CuPy arrays are copied on their GPU (not pooled).
3. ``gdsckpt.save`` runs on the snapshot in a background thread; its buffers return to the pool
   when it ends, successful or not. The caller may change its tensors as soon as ``save_async``
   returned.

Either way the background save compresses on the tensors' GPU (the GPU engine copies pinned
snapshot bytes into its staging ring, asynchronously, and compresses there) and the index records
the device the tensors were on, exactly as ``gdsckpt.save`` of the live state would.
Why a raw copy and not a compressed one: compressing at call time (nvCOMP ANS, ~50 GB/s through
the whole pipeline) would block ~25 times longer than a device copy and save only the ratio's
share of the memory (1.25x on a trained mixed-precision state); the stall is what users pay.
Without a usable GPU engine (no nvCOMP), the CPU engine compresses the pinned snapshot.
``Config.async_engine="cpu"`` makes the CPU engine compress it in any case (reading a GPU
snapshot chunk by chunk into host memory): with ``async_worker="process"`` the background save
then does no CUDA work in the training process and no kernels at all, which is what kept a
training loop closest to its speed without checkpoints (docs/performance.md, "Async saves").

Memory: at most ``max_inflight`` snapshots exist at once, so the pool holds at most
``max_inflight`` times the state's bytes (on the GPU only when the state fits
``snapshot_gpu_bytes``) (buffers of sizes a newer snapshot no longer uses are
dropped once the pool would exceed that bound, also while that snapshot is being taken: the
bound holds while a state whose arrays changed size is copied). ``pool_stats()`` reports it;
``clear_pool()`` frees the idle buffers.

Errors are never lost: ``SaveHandle.wait()`` raises the background error (the same exception
object), ``exception()`` returns it. When a handle is dropped without either, the error is logged
(logger ``gdsckpt``) and raised by the next ``save_async`` call (of any saver) or by
``wait_all()``. ``wait_all()`` also raises errors of handles still held but never waited on.

Interpreter exit: in-flight saves are waited for (each up to its config's ``timeout``); a save
that is still running after that is abandoned, and because ``gdsckpt.save`` writes to a
temporary file renamed over the target only once complete, the target keeps its previous content
(a leftover temporary file is removed by the next save to that path).

The snapshot pool and the copying live in ``snapshot``; this module holds the jobs, the handles
and the savers (in-process threads, or the save worker process of ``worker``).
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, cast

from .. import api as _api
from ..api import inflight
from ..api import saving as api_saving
from ..api.resolve import check_target, resolve_config
from ..api.saving import refuse_replacing_base
from ..config import Config
from ..io.fileobj import FileObjectWriter, is_file_object
from ..io.pools import Gate, reentry_message, refuse_reentry
from ..io.s3 import is_url
from ..state import flatten
from ..state.delta import DEFAULT_MAX_CHAIN
from .snapshot import PoolStats, SnapshotPool, take_snapshot

PathLike = str | os.PathLike[str]

logger = logging.getLogger("gdsckpt")



# ---------------------------------------------------------------------------------------------
# jobs, handles, savers

_registry_lock = threading.RLock()  # an RLock only so that a thread holding it can be told (refuse_reentry)
_unobserved: list[_Job] = []
"""Jobs that failed and whose error nobody has seen yet (wait/exception/wait_all)."""
_savers: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()


class _Job:
    def __init__(self, saver: AsyncSaver, path: PathLike, timeout: float):
        self.saver = saver
        self.target = path
        """What the save writes to, as given (a file object or writer is written to, not its str)."""
        self.path = str(path)
        self.flight: inflight.Flight | None = None
        """Its place among the operations in flight (``api.inflight``), from the slot on."""
        self.timeout = timeout
        self.ended = False
        """Set, under the saver's lock, once the job has ended (its thread or its caller)."""
        self.lock = threading.Lock()
        self.report: _api.SaveReport | None = None
        self.error: BaseException | None = None
        self.observed = False
        self.dropped = False
        self.claimed = False
        self.snapshot_seconds = 0.0
        self.snapshot_bytes = 0
        self.starter: int | None = threading.get_ident()
        """The thread whose ``save_async`` call is still starting the job (taking its snapshot),
        None once its thread runs it: a signal handler that ran in that call's frame waits for
        no such job (``_wait_inflight``), since the job can only go on when the handler returns."""

    def has_ended(self) -> bool:
        """Whether the job has ended (read under the saver's lock while waiting for it)."""
        return self.ended

    def claim(self) -> bool:
        """Take the job's end on oneself: True for the first caller only (its thread, or the
        caller whose start of that thread failed)."""
        with self.lock:
            claimed, self.claimed = self.claimed, True
        return not claimed

    def finish_error(self, error: BaseException) -> None:
        with self.lock:
            self.error = error
            orphan = self.dropped
        with _registry_lock:
            _unobserved.append(self)
        if orphan:
            _log_orphan(self)

    def observe(self) -> None:
        with self.lock:
            self.observed = True
        with _registry_lock:
            if self in _unobserved:
                _unobserved.remove(self)

    def handle_dropped(self) -> None:
        # ``error`` and ``dropped`` change under the lock: exactly one of this and finish_error logs.
        with self.lock:
            self.dropped = True
            log = self.error is not None and not self.observed
        if log:
            _log_orphan(self)


def _log_orphan(job: _Job) -> None:
    logger.error("gdsckpt: background save to %s failed and its SaveHandle was dropped without wait(); "
                 "the next save_async() or wait_all() raises it: %r", job.path, job.error,
                 exc_info=job.error)


def _take_errors(*, saver: AsyncSaver | None = None, orphans_only: bool = False) -> None:
    """Raise the first unobserved error (of ``saver`` / of dropped handles only), marking every
    selected one observed; a note on the raised error counts the others (all were logged)."""
    with _registry_lock:
        chosen = [job for job in _unobserved
                  if (saver is None or job.saver is saver) and (not orphans_only or job.dropped)]
        for job in chosen:
            _unobserved.remove(job)
    if not chosen:
        return
    for job in chosen:
        with job.lock:
            job.observed = True
    error = chosen[0].error
    assert error is not None
    for job in chosen[1:]:
        logger.error("gdsckpt: background save to %s failed: %r", job.path, job.error, exc_info=job.error)
    add_note = getattr(error, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        if len(chosen) > 1:
            add_note(f"gdsckpt: {len(chosen) - 1} more background save(s) failed too (logged)")
        add_note(f"gdsckpt: raised from the background save to {chosen[0].path}")
    raise error


class SaveHandle:
    """The handle of one ``save_async``: ``wait()``, ``done()``, ``exception()``."""

    def __init__(self, job: _Job):
        self._job = job
        finalizer = weakref.finalize(self, _Job.handle_dropped, job)
        finalizer.atexit = False  # at exit, _at_exit reports unobserved errors

    @property
    def path(self) -> str:
        """The checkpoint path being written."""
        return self._job.path

    @property
    def snapshot_seconds(self) -> float:
        """Seconds ``save_async`` spent validating and copying the state: the training stall (a
        wait for a free slot under ``max_inflight`` is not counted)."""
        return self._job.snapshot_seconds

    @property
    def snapshot_bytes(self) -> int:
        """Bytes copied into snapshot buffers."""
        return self._job.snapshot_bytes

    def done(self) -> bool:
        """True once the save has finished, successfully or not."""
        return self._job.ended

    def wait(self, timeout: float | None = None) -> _api.SaveReport:
        """Block until the save is durable at ``path`` and return its ``SaveReport``; raise the
        background error if it failed, ``TimeoutError`` if ``timeout`` seconds pass first (the save
        goes on)."""
        self._wait(timeout)
        if self._job.error is not None:
            raise self._job.error
        assert self._job.report is not None
        return self._job.report

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block like ``wait`` and return the background error, or None when the save succeeded."""
        self._wait(timeout)
        return self._job.error

    def _wait(self, timeout: float | None) -> None:
        job = self._job
        job.saver._refuse_waits_under_held_locks()
        if not job.saver.ended.wait_for(job.has_ended, timeout):
            raise TimeoutError(f"save to {self.path!r} still running after {timeout} s")
        self._job.observe()

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._job.error is not None else "done")
        return f"<SaveHandle {self.path!r} {state}>"


def _background_config(config: Config) -> Config:
    """The config the background save runs with: ``config`` with ``engine`` set to
    ``async_engine`` unless that is ``"auto"``. A separate field, not ``engine`` itself, because
    the engine that suits a background save (the CPU's, from a worker process: the GPU stays with
    training) is not the one that suits a restore or a blocking save of the same job."""
    return config if config.async_engine == "auto" else config.replace(engine=config.async_engine)


def _check_max_inflight(max_inflight: Any) -> None:
    if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
        raise ValueError(f"max_inflight must be an int >= 1, got {max_inflight!r}")


def _absolute(location: Any) -> Any:
    """A relative local path made absolute now; anything else (a URL, a writer) as it is."""
    if isinstance(location, (str, os.PathLike)) and not is_url(location) and not os.path.isabs(location):
        return os.path.abspath(location)
    return location


_BOOKKEEPING = "save_async's bookkeeping"


class AsyncSaver:
    """Runs background saves with a bounded number in flight and its own snapshot pool.

    ``gdsckpt.save_async`` uses one module-wide saver; each ``CheckpointManager`` has its own.
    """

    def __init__(self) -> None:
        self.pool = SnapshotPool()
        self._slots = Gate(what=_BOOKKEEPING)
        """Guards ``_inflight``; its waiters are callers waiting for a slot under ``max_inflight``."""
        self.ended = Gate(self._slots.lock, what=_BOOKKEEPING)
        """Its waiters wait for saves to end (a handle's ``wait``, ``wait_all``)."""
        self._inflight: list[_Job] = []
        self._worker: Any = None  # gdsckpt.background.worker.SaveWorker, made on the first process save
        self._worker_lock = threading.Lock()
        self.end_locks: list[tuple[Any, str]] = []
        """(lock, what it guards) that the ``after`` / ``finally_`` hooks of this saver's saves
        take (a ``CheckpointManager``'s), for ``_refuse_waits_under_held_locks``."""
        _savers.add(self)

    @property
    def inflight(self) -> int:
        """Saves started and not yet finished."""
        with self._slots.lock:
            return len(self._inflight)

    @property
    def waiting(self) -> int:
        """Callers blocked in ``save`` until an earlier save finishes (``max_inflight``)."""
        return self._slots.waiting

    def save(self, state: Any, path: PathLike, *, codec: str = "auto", chunk_bytes: int | str | None = None,
             config: Config | None = None, max_inflight: int = 1,
             after: Callable[[_api.SaveReport], None] | None = None,
             finally_: Callable[[BaseException | None], None] | None = None, base: PathLike | None = None,
             max_chain: int = DEFAULT_MAX_CHAIN, lossy: Any = None, force: bool = False) -> SaveHandle:
        """``save_async`` on this saver. ``after(report)`` runs in the background thread once the
        file is complete (its error counts as the save's); ``finally_(error)`` runs there at the
        end, with the save's error or None, and in the caller if the save never starts."""
        try:
            return self._save(state, path, codec=codec, chunk_bytes=chunk_bytes, config=config,
                              max_inflight=max_inflight, after=after, finally_=finally_,
                              delta={"base": base, "max_chain": max_chain, "lossy": lossy}, force=force)
        except BaseException as err:
            if finally_ is not None:
                finally_(err)
            raise

    def _save(self, state: Any, path: PathLike, *, codec: str, chunk_bytes: int | str | None,
              config: Config | None, max_inflight: int, after: Callable[[_api.SaveReport], None] | None,
              finally_: Callable[[BaseException | None], None] | None, delta: dict[str, Any],
              force: bool = False) -> SaveHandle:
        self._refuse_waits_under_held_locks()  # a slot may need an earlier save to end
        _check_max_inflight(max_inflight)
        api_saving.check_save_arguments(codec, chunk_bytes, config, delta.get("lossy"))
        _take_errors(orphans_only=True)
        cfg = config if config is not None else Config.from_env()
        if is_file_object(path):  # as gdsckpt.save writes to one
            path = cast(Any, FileObjectWriter(path))
        # A relative path names the file where the caller is now, not where the process is when
        # the background thread writes it (an os.chdir in between).
        path, base = _absolute(path), _absolute(delta.get("base"))
        delta = {**delta, "base": base}
        check_target(path)  # a bad directory fails here, not in the background
        if cfg.async_worker == "process" and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"save_async with Config(async_worker='process') saves to a path or an s3:// URL; "
                            f"a {type(path).__qualname__} cannot be handed to the worker process")
        if not force:
            refuse_replacing_base(path, cfg)  # so does replacing a delta's base
        started = time.perf_counter()
        devices, cuda_bytes = _survey(state)  # a state gdsckpt.save would reject fails here
        validated = time.perf_counter()
        self._refuse_reentry()
        job = _Job(self, path, cfg.timeout)
        lent: list[Any] = []
        # One try from the slot to the thread's start: a ^C anywhere in between (one can land
        # between any two statements) ends the job, or the saver would count it in flight for
        # ever. A ^C can also land while start() waits for a thread it has already made: that
        # thread then runs the save, and returning its snapshot buffers here would let the next
        # save copy another state into them under it. Whichever side claims the job first ends it.
        try:
            if not self._slots.wait_for(lambda: len(self._inflight) < max_inflight, cfg.timeout,
                                        then=lambda: self._inflight.append(job)):
                raise TimeoutError(f"save_async to {str(path)!r}: {max_inflight} earlier save(s) still in "
                                   f"flight after {cfg.timeout} s (config timeout)")
            # Saves of one file, of a delta's base, or reading this file as a base, by any saver
            # or a blocking save, run one after another: the older could otherwise replace the
            # newer, or a delta be written against a base then replaced under it. The place
            # belongs to the background thread (owner 0 until it starts), so a blocking save
            # this caller makes next waits for it.
            job.flight, waited_for_tied = inflight.board(path, base, cfg.timeout, owner=0, what="save_async")
            if waited_for_tied and not force:  # a delta on this file, in flight at the call, is on disk now
                refuse_replacing_base(path, cfg)
            slot = time.perf_counter()
            in_process = cfg.async_worker == "process"
            snapshot, lent, nbytes = take_snapshot(state, self.pool, validate=False,
                                                   cuda_on_device=0 < cuda_bytes <= cfg.snapshot_gpu_bytes,
                                                   shared=in_process)
            job.snapshot_seconds = (validated - started) + (time.perf_counter() - slot)
            job.snapshot_bytes = nbytes
            handle = SaveHandle(job)
            thread = threading.Thread(target=self._run, name="gdsckpt-async-save", daemon=True,
                                      args=(job, [snapshot], lent, max_inflight,
                                            dict(codec=codec, chunk_bytes=chunk_bytes, config=_background_config(cfg),
                                                 devices=devices if cuda_bytes else None, background=True, **delta),
                                            after, finally_, in_process))
            thread.start()
            with self._slots.lock:
                job.starter = None  # running: waits wait for it (its thread clears it too, if first)
        except BaseException:
            if job.claim():
                if lent:
                    self.pool.release(lent, copies=max_inflight)
                self._end(job)
            raise
        return handle

    def _run(self, job: _Job, holder: list[Any], lent: list[Any], copies: int, options: dict[str, Any],
             after: Callable[[_api.SaveReport], None] | None,
             finally_: Callable[[BaseException | None], None] | None,
             in_process: bool = False) -> None:
        if not job.claim():
            return  # the caller gave the job up (its start was interrupted) and ended it
        job.starter = None
        if job.flight is not None:
            job.flight.owner = threading.get_ident()
        try:
            if in_process:
                report = self.worker().save(holder.pop(), lent, job.path, options, job.timeout)
            else:
                report = api_saving.save_flat(flatten(holder.pop()), job.target, **options)
            if after is not None:
                after(report)
            job.report = report
        except BaseException as err:  # noqa: BLE001 - handed to the caller through the handle
            job.finish_error(err)
        finally:
            holder.clear()
            self.pool.release(lent, copies=copies)
            if finally_ is not None:
                try:
                    finally_(job.error)
                except BaseException as err:  # noqa: BLE001
                    if job.error is None:
                        job.finish_error(err)
            self._end(job)

    def _end(self, job: _Job) -> None:
        if job.flight is not None:
            inflight.land(job.flight)
        with self._slots.lock:
            if job in self._inflight:
                self._inflight.remove(job)
            job.ended = True
            self._slots.notify_all()
            self.ended.notify_all()

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait for every save in flight; then raise the first error of this saver's saves that no
        handle has reported (``TimeoutError`` if ``timeout`` seconds pass first)."""
        self._wait_inflight(timeout)
        _take_errors(saver=self)

    def _refuse_reentry(self) -> None:
        """``RuntimeError`` where this thread is inside a ``save_async`` of this saver that has
        not started its job's thread yet: a signal handler that interrupted that call and saves
        again would wait for the slot or the file the interrupted call holds, for ever."""
        me = threading.get_ident()
        with self._slots.lock:
            starting = any(job.starter == me for job in self._inflight)
        if starting:
            raise RuntimeError(reentry_message("save_async (taking its snapshot)"))

    def _refuse_waits_under_held_locks(self) -> None:
        """``RuntimeError`` where this thread holds a lock that the end of a background save of
        this saver takes (the bookkeeping of the saves in flight, the registry of their errors,
        the locks of ``end_locks``): a wait for one would wait for this thread, that is for ever
        (a signal handler that interrupted this thread there and waits; its save is refused the
        same way by ``Gate.wait_for``)."""
        for lock, what in ((inflight.bookkeeping_lock(), "the bookkeeping of the saves and loads in flight"),
                           (_registry_lock, "the registry of background saves' errors"), *self.end_locks):
            refuse_reentry(lock, what)

    def _wait_inflight(self, timeout: float | None) -> bool:
        self._refuse_waits_under_held_locks()
        me = threading.get_ident()
        # A job this thread is still starting goes on only once this call returns (a signal
        # handler waiting inside that save_async's frame): waiting for it would never end.
        if self.ended.wait_for(lambda: all(job.starter == me for job in self._inflight), timeout):
            return True
        with self._slots.lock:
            running = [job.path for job in self._inflight]
        raise TimeoutError(f"save to {running[0] if running else '?'!r} still running after {timeout} s")

    def clear_pool(self) -> int:
        """Drop the idle snapshot buffers; returns the bytes freed."""
        return self.pool.clear()

    def worker(self) -> Any:
        """This saver's ``gdsckpt.background.worker.SaveWorker`` (made on first use; its process starts on
        the first save with ``Config(async_worker="process")`` or in ``prepare``)."""
        with self._worker_lock:
            if self._worker is None:
                from .worker import SaveWorker

                self._worker = SaveWorker()
            return self._worker

    def close_worker(self, timeout: float = 10.0, *, when: str = "on close_worker") -> None:
        """Stop this saver's worker process, if any, after the saves in flight (each waited for
        up to its config timeout, then abandoned with an error logged; the worker restarts on the
        next process save). ``timeout``: how long the worker may take to exit; ``when`` names
        the occasion in that log line."""
        with self._slots.lock:
            jobs = list(self._inflight)
        for job in jobs:
            if not self.ended.wait_for(job.has_ended, job.timeout):
                logger.error("gdsckpt: abandoning the background save to %s %s after %s s; the path "
                             "keeps its previous content", job.path, when, job.timeout)
        with self._worker_lock:
            worker = self._worker
        if worker is not None:
            worker.close(timeout)

    def prepare(self, state: Any, *, config: Config | None = None, max_inflight: int = 1) -> int:
        """Allocate now the snapshot buffers that ``save`` of a state like ``state`` will use
        (same arrays, sizes and devices), so that the first background save in a training loop
        does not pay for them: allocating pinned memory takes tens of times longer than the copy
        into buffers that exist (docs/performance.md, "Async saves"). Copies ``state`` once,
        and keeps the buffers idle in this saver's pool; with ``Config(async_worker="process")``
        also starts the worker process. Returns the bytes the pool holds."""
        _check_max_inflight(max_inflight)
        cfg = config if config is not None else Config.from_env()
        _devices, cuda_bytes = _survey(state)
        in_process = cfg.async_worker == "process"
        _snapshot, lent, _nbytes = take_snapshot(state, self.pool, validate=False,
                                                 cuda_on_device=0 < cuda_bytes <= cfg.snapshot_gpu_bytes,
                                                 shared=in_process)
        self.pool.release(lent, copies=max_inflight)
        if in_process:
            self.worker().start(cfg.timeout)
        return self.pool.stats().held_bytes


def _survey(state: Any) -> tuple[list[str], int]:
    """Validate ``state`` as ``gdsckpt.save`` does; return each array's device (flatten order) and
    the bytes of its CUDA torch tensors (what a GPU snapshot would take)."""
    flat = flatten(state)
    devices = [array.device for array in flat.arrays]
    cuda_bytes = sum(a.source.nbytes for a in flat.arrays
                     if a.alias is None and a.kind == "torch" and a.device.startswith("cuda"))
    return devices, cuda_bytes


_default_saver = AsyncSaver()


def save_async(state: Any, path: PathLike, *, codec: str = "auto", chunk_bytes: int | str | None = None,
               config: Config | None = None, max_inflight: int = 1, base: PathLike | None = None,
               max_chain: int = DEFAULT_MAX_CHAIN, lossy: Any = None, force: bool = False,
               portable: bool | None = None) -> SaveHandle:
    """Start saving ``state`` to ``path`` in the background; return once a snapshot exists.

    Arguments as for ``gdsckpt.save`` (``portable``; ``base``: write a delta against that checkpoint; ``force``:
    replace a checkpoint that deltas use as their base, else refused here; ``lossy``:
    round the snapshot's selected arrays, in the background). When this returns, every tensor and array of ``state`` has
    been copied into reused snapshot buffers (CUDA tensors on their GPU when they fit
    ``config.snapshot_gpu_bytes``, else into pinned host memory), so the caller may update them
    right away; the file appears at ``path`` atomically once the background save completes,
    exactly as with ``gdsckpt.save``, compressed on the GPU for CUDA tensors. ``prepare(state)``
    allocates the buffers ahead of the training loop.

    At most ``max_inflight`` saves of this module-wide saver run at once: a further call blocks
    until an earlier one finishes (``TimeoutError`` after ``config.timeout`` seconds). So does a
    call whose ``path`` an earlier save in flight writes or reads as its base, or whose ``base``
    one writes, whichever API started it (``gdsckpt.save``, ``convert``, ``rebase``, a
    ``CheckpointManager``): saves of one file complete in the order they were called (else the
    older could replace the newer, or a delta be written against a base replaced under it), and
    those blocking calls wait for this one in the same way (``gdsckpt.api.inflight``). A relative
    ``path`` or ``base`` names the file where the caller is at the call. Snapshot
    memory is bounded by ``max_inflight`` times the state's bytes and reused across calls
    (``pool_stats()``).

    ``path`` may be a binary file object, as for ``gdsckpt.save`` (not with
    ``Config(async_worker="process")``, which hands the path to another process).

    Raises, in the caller: ``TypeError`` / ``ValueError`` for a state ``gdsckpt.save`` would reject,
    ``TypeError`` for a ``path`` that is not a path, URL, writer or file object,
    ``FileNotFoundError`` / ``IsADirectoryError`` for a bad path, ``DeltaBaseError`` for a
    ``path`` that deltas use as their base (see ``gdsckpt.save``), and the error of an earlier
    background save whose handle was dropped without ``wait()`` (this save is then not started).

    The index records the device each tensor was on (``cuda:N`` for CUDA tensors), as
    ``gdsckpt.save`` of the live state would.

    Returns a ``SaveHandle``: ``wait(timeout=None) -> SaveReport``, ``done()``, ``exception()``.
    """
    if portable is not None:
        config = resolve_config(config, portable=portable)
    return _default_saver.save(state, path, codec=codec, chunk_bytes=chunk_bytes, config=config,
                               max_inflight=max_inflight, base=base, max_chain=max_chain, lossy=lossy,
                               force=force)


def wait_all(timeout: float | None = None) -> None:
    """Wait for every background save (``save_async`` and ``CheckpointManager.save_async``), then
    raise the first error that no ``SaveHandle`` reported, if any (the others are logged)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for saver in list(_savers):
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        saver._wait_inflight(remaining)
    _take_errors()


def prepare(state: Any, *, config: Config | None = None, max_inflight: int = 1) -> int:
    """``AsyncSaver.prepare`` for ``gdsckpt.save_async``: allocate its snapshot buffers for a
    state like ``state`` now, outside the training loop; returns the bytes its pool holds."""
    return _default_saver.prepare(state, config=config, max_inflight=max_inflight)


def pool_stats() -> PoolStats:
    """Statistics of the snapshot pool of ``gdsckpt.save_async``."""
    return _default_saver.pool.stats()


def clear_pool() -> int:
    """Free the idle snapshot buffers of ``gdsckpt.save_async``; returns the bytes freed."""
    return _default_saver.clear_pool()


# ---------------------------------------------------------------------------------------------
# interpreter exit

def _forget_after_fork() -> None:
    """A forked child has none of the savers' threads (nor their worker process): their saves in
    flight would never end there, and ``wait_all``, a later ``save_async`` and the exit hook
    would wait on them (for ever, or ``Config.timeout``). Their handles, copied into the child,
    fail at once there: the save goes on in the parent, which alone can wait for it. Each saver
    gets a pool of its own, since the parent's snapshot buffers for a worker process are memory
    both share (``MAP_SHARED``): a save in the child would copy its state into them. Errors
    nobody has seen yet are the parent's to report."""
    global _registry_lock
    _registry_lock = threading.RLock()
    _unobserved.clear()
    for saver in list(_savers):
        saver._slots = Gate(what=_BOOKKEEPING)
        saver.ended = Gate(saver._slots.lock, what=_BOOKKEEPING)
        for job in saver._inflight:
            job.lock = threading.Lock()
            job.error = RuntimeError(f"gdsckpt: the background save to {job.path} runs in the process that "
                                     f"forked this one (pid {os.getppid()}); only that process can wait for it")
            job.observed = True
            job.ended = True
        saver._inflight = []
        saver.pool = SnapshotPool()
        saver._worker = None
        saver._worker_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def _at_exit() -> None:
    """Let in-flight saves finish (each up to its config timeout); report what cannot."""
    for saver in list(_savers):
        saver.close_worker(timeout=1.0, when="at interpreter exit")
    with _registry_lock:
        jobs = list(_unobserved)
        _unobserved.clear()
    for job in jobs:
        logger.error("gdsckpt: background save to %s failed and nobody waited for it: %r", job.path,
                     job.error, exc_info=job.error)


# threading's exit hooks run before concurrent.futures stops accepting work (hooks run in reverse
# order of registration and concurrent.futures registered first), so a waited-for save can still
# use its thread pools. Plain atexit would run after that.
threading._register_atexit(_at_exit)  # type: ignore[attr-defined]  # private, in every CPython >= 3.9


__all__ = ["AsyncSaver", "PoolStats", "SaveHandle", "SnapshotPool", "clear_pool", "pool_stats", "prepare",
           "save_async", "take_snapshot", "wait_all"]
