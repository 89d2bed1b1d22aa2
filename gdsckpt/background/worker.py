"""Background saves in a worker process (``Config(async_worker="process")``).

Why
---
With ``async_worker="thread"`` (the default) a ``save_async`` runs ``gdsckpt.save`` on a thread of
the training process. That thread and the pipeline's own threads (encode, write, checksum) hold
the GIL in short bursts all through the save, and the training loop, which launches its kernels
from Python, waits for it: a training step of 31.3 ms took 36.9 ms while a save ran
into a null sink, and 39-43 ms into a file (``experiments/async_profile.py``). The copy engines,
nvCOMP's kernels and polling alone did not slow it. A separate process has its own GIL.

How
---
- One worker process per ``AsyncSaver`` (``gdsckpt.save_async`` has one, each
  ``CheckpointManager`` its own), started on first use or by ``prepare``, and kept: it imports
  torch and creates its CUDA context once. It is started with ``subprocess`` running
  ``python -c`` (a fresh interpreter, never a fork, and never a re-run of the caller's
  ``__main__`` as ``multiprocessing``'s spawn would do in a script without a main guard).
- The snapshot stays where ``save_async`` copied it; the worker maps its buffers once and reuses
  the mapping for every later save that uses them. Host buffers are ``memfd_create`` memory
  mapped by both processes (the descriptor goes over a Unix socket, ``socket.send_fds``), page-locked in
  both with ``cudaHostRegister`` where CUDA is present, so the parent's device-to-host copies
  and the worker's host-to-device copies run at pinned speed. GPU buffers go through CUDA IPC
  (torch's reductions). Host buffers under 1 MiB are carved from 64 MiB shared slabs, so a
  state of 100,000 small tensors needs a few descriptors, not 100,000. A message then carries
  only the state's structure, with each tensor replaced by (buffer, dtype, shape, strides,
  offset); NumPy, CuPy and JAX arrays go by value.
- The worker writes the file as ``gdsckpt.save`` does, but stops before the rename: the complete,
  fsynced file is left at a temporary path, and the training process, which owns the snapshot,
  renames it over the target and fsyncs the directory. A worker still writing when the training
  process dies may read freed memory, but its file is never renamed (and the next save to that
  path removes it); the worker exits within half a second of the training process. An
  ``s3://`` object becomes visible only when its upload completes, which the worker does itself,
  after checking that the training process is still there.
- ``Config.timeout`` bounds each silence of the worker, not a save's length: while a save runs
  the worker sends a heartbeat every ``POLL_SECONDS``; one that stops sending (stopped, stuck)
  or does not take a save's message within the timeout is killed and the save fails.
- A save that fails leaves both sides as they were: the buffers its message introduced count as
  mapped only once the worker reports the save done.
- Errors come back pickled (the same exception type, with the worker's traceback as a note); a
  worker that dies or falls silent for ``Config.timeout`` fails that save with ``SaveWorkerError`` and is
  replaced on the next save.

Cost: the worker's interpreter, torch and (with CUDA tensors) a CUDA context of its own, a few
hundred MiB of GPU memory, on top of ``max_staging_bytes``; its start (seconds) on the first save
or in ``prepare``; the open slab (up to 64 MiB of host memory each, pinned and not) stays
allocated for the next save.

Why both a worker process and ``async_engine="cpu"`` (docs/performance.md, "Async saves", has
the figures): with the GPU engine the worker alone left a training loop's speed where the thread
left it, since its kernels and copies still share the GPU with training; the CPU engine in a
thread still costs the loop its Python threads' share of the GIL. Together they kept the loop
closest to its speed without checkpoints: the worker process is what lets the save run off the
GPU without taking the training process's time. The ``async-training`` preset
(``Config.preset``) sets both.

Why one module of about 700 lines: the parent's side (``SaveWorker``: spawning, handing over
buffers, waiting with bounds) and the child's side (``_serve``) speak one private message protocol
of pickled dicts and shared-memory buffers; kept in one file, a change to a message is made on
both sides at once.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import io
import logging
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import SaveWorkerError
from ..io.posix import publish
from ..io.s3 import is_url

logger = logging.getLogger("gdsckpt")

WORKER_NICE = 10
"""The worker's scheduling niceness: the training process's threads (which launch its kernels)
come first where the CPUs are busy with the save's copies, checksums and writes."""

POLL_SECONDS = 0.5
"""How often the parent checks a silent worker and the worker checks its parent."""

_ENV_SYSPATH = "GDSCKPT_WORKER_SYSPATH"
_ENV_PARENT = "GDSCKPT_WORKER_PARENT"
_ENV_WARM = "GDSCKPT_WORKER_WARM"
_WARM_MODULES = ("torch", "cupy", "nvidia.nvcomp", "kvikio", "zstandard")
"""Imported by the worker before it reports ready when the caller has them loaded: the first save
then pays neither their imports (torch: over a second) nor CUDA's initialisation."""
_BOOT = ("import os, sys; sys.path[:0] = os.environ['GDSCKPT_WORKER_SYSPATH'].split(os.pathsep); "
         "from gdsckpt.background.worker import _main; _main()")

# ---------------------------------------------------------------------------------------------
# shared host buffers (parent side)

class _ByIdentity:
    """A mapping from live objects, compared by identity, to values; an entry goes when its
    object is collected. (``WeakKeyDictionary`` compares keys with ``==``, which tensors answer
    elementwise.)"""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], Any]] = {}

    def __setitem__(self, key: Any, value: Any) -> None:
        ident = id(key)
        self._entries[ident] = (weakref.ref(key, lambda _ref: self._entries.pop(ident, None)), value)

    def get(self, key: Any, default: Any = None) -> Any:
        entry = self._entries.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else default

    def __getitem__(self, key: Any) -> Any:
        entry = self._entries.get(id(key))
        if entry is None or entry[0]() is not key:
            raise KeyError("not a registered buffer")
        return entry[1]

    def values(self) -> list[Any]:
        """The values of the live keys."""
        return [value for ref, value in list(self._entries.values()) if ref() is not None]


_host_buffers = _ByIdentity()
"""Host snapshot buffer -> (memfd, page-locked, root) for the buffers ``shared_host_buffer`` made;
the root is the slab a buffer was carved from, or None for a buffer of its own (the worker maps
roots)."""


SLAB_BYTES = 64 << 20
"""Host snapshot buffers below ``SLAB_BELOW`` bytes are carved from shared slabs of this size: a
state of 100,000 small tensors would otherwise take 100,000 descriptors and mappings (the limits
are typically 1,024-65,536 descriptors and 65,530 mappings per process)."""
SLAB_BELOW = 1 << 20
_SLAB_ALIGN = 64  # every dtype's item size divides it


class _Slabs:
    """Carves small shared host buffers out of ``SLAB_BYTES`` slabs (one open slab per pinning).
    A slab's memory lives while any buffer carved from it does (they are views of it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[bool, tuple[Any, int]] = {}  # pinned -> (slab, bytes used)

    def carve(self, nbytes: int, pin: bool) -> Any:
        with self._lock:
            slab, used = self._open.get(pin, (None, SLAB_BYTES))
            if used + nbytes > SLAB_BYTES:
                slab, used = _new_shared(SLAB_BYTES, pin), 0
            self._open[pin] = (slab, used + -(-nbytes // _SLAB_ALIGN) * _SLAB_ALIGN)
        buffer = slab[used:used + nbytes]
        fd, pinned, _root = _host_buffers[slab]
        _host_buffers[buffer] = (fd, pinned, slab)  # keeps the slab (and its memfd) while in use
        return buffer


_slabs = _Slabs()


def _forget_slabs_after_fork() -> None:
    """A forked child shares the parent's slabs (``MAP_SHARED`` memory): carving its snapshots
    from them would write into the parent's snapshots in flight. The child opens its own."""
    global _slabs
    _slabs = _Slabs()


os.register_at_fork(after_in_child=_forget_slabs_after_fork)


def shared_host_buffer(nbytes: int, *, pin: bool) -> Any:
    """A 1-D uint8 CPU torch tensor over ``memfd_create`` memory, which a worker process can map
    too; ``pin``: page-lock it with ``cudaHostRegister`` (for copies from CUDA tensors). Buffers
    below ``SLAB_BELOW`` bytes are views of a shared slab."""
    if nbytes < SLAB_BELOW:
        return _slabs.carve(nbytes, pin)
    return _new_shared(nbytes, pin)


def _new_shared(nbytes: int, pin: bool) -> Any:
    import torch

    fd = os.memfd_create("gdsckpt-snapshot", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    pinned = pin and _register(buffer.data_ptr(), nbytes)
    _host_buffers[buffer] = (fd, pinned, None)  # None: the buffer is its own root (no self-reference)
    # Not at exit: CUDA may be torn down by then, and the process's end frees both anyway.
    weakref.finalize(buffer, _release_host, fd, buffer.data_ptr() if pinned else 0).atexit = False
    return buffer


def _register(pointer: int, nbytes: int) -> bool:
    """Page-lock host memory for CUDA copies; False (and the memory stays pageable) where CUDA
    cannot."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        return int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 0)) == 0
    except Exception as err:  # noqa: BLE001 - pageable memory still works, only slower
        logger.warning("gdsckpt: cudaHostRegister of a %d-byte snapshot buffer failed (%s); copies "
                       "use pageable memory", nbytes, err)
        return False


def _unregister(pointer: int) -> None:
    if pointer:
        import torch

        torch.cuda.cudart().cudaHostUnregister(pointer)


def _release_host(fd: int, pointer: int) -> None:
    try:
        _unregister(pointer)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# messages

class _SnapshotPickler(pickle.Pickler):
    """Pickles a snapshot with its pooled tensors as references to buffers the worker maps."""

    def __init__(self, file: Any, buffers: dict[int, int]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.buffers = buffers  # storage data pointer -> buffer id
        self._torch = sys.modules.get("torch")

    def persistent_id(self, obj: Any) -> Any:
        torch = self._torch
        if torch is None or type(obj) is not torch.Tensor or obj.numel() == 0:
            return None
        bid = self.buffers.get(obj.untyped_storage().data_ptr())
        if bid is None:
            return None
        return ("tensor", bid, str(obj.dtype).removeprefix("torch."), tuple(obj.shape), obj.stride(),
                obj.storage_offset())


class _SnapshotUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, buffers: dict[int, Any]):
        super().__init__(file)
        self.buffers = buffers

    def persistent_load(self, pid: Any) -> Any:
        import torch

        _kind, bid, dtype, shape, stride, offset = pid
        if bid not in self.buffers:  # the two sides disagree: the parent replaces this worker
            raise SaveWorkerError(f"the save names shared buffer {bid}, which this worker has not mapped")
        return self.buffers[bid].view(getattr(torch, dtype)).as_strided(shape, stride, offset)


def _dumps_cuda(buffers: dict[int, Any]) -> bytes:
    """CUDA buffers pickled with torch's reductions (CUDA IPC handles, no copy)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

    return bytes(ForkingPickler.dumps(buffers))


def _error_payload(error: BaseException) -> bytes:
    """The exception pickled, with the worker's traceback as a note; a RuntimeError in its place
    when it does not survive pickling."""
    text = "".join(traceback.format_exception(error))
    try:
        add_note = getattr(error, "add_note", None)
        if add_note is not None:
            add_note(f"gdsckpt: raised in the save worker process (pid {os.getpid()}):\n{text}")
        payload = pickle.dumps(error)
        pickle.loads(payload)
        return payload
    except Exception:  # noqa: BLE001 - not picklable: send its text instead
        return pickle.dumps(SaveWorkerError(f"{type(error).__name__}: {error}\n"
                                            f"(raised in the save worker process)\n{text}"))


# ---------------------------------------------------------------------------------------------
# the parent's handle on a worker

class SaveWorker:
    """A worker process running the background saves of one ``AsyncSaver``, one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Any = None
        self._fds: socket.socket | None = None
        self._known = _ByIdentity()  # buffer -> id in the worker
        self._next_id = 0
        self._next_job = 0

    @property
    def pid(self) -> int | None:
        """The worker's process id, or None when none runs."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def start(self, timeout: float) -> int:
        """Start the worker unless it runs; wait until it is ready (``timeout`` seconds); return
        its pid."""
        with self._lock:
            self._ensure(timeout)
            assert self._process is not None
            return self._process.pid

    def _ensure(self, timeout: float) -> None:
        if self._process is not None and self._process.poll() is None:
            return
        self._discard()
        from multiprocessing.connection import Connection

        parent_msgs, child_msgs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        parent_fds, child_fds = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        # The caller's import path ('' is its working directory), so the worker imports the same
        # gdsckpt (and any module the state's pickles name) before it imports anything else.
        env[_ENV_SYSPATH] = os.pathsep.join(_import_path())
        try:
            os.getcwd()
            cwd = None
        except OSError:  # removed: libraries the worker loads (MKL's) fail to start in it
            cwd = "/"
        env[_ENV_PARENT] = str(os.getpid())
        env[_ENV_WARM] = ",".join(_warm_up_list())
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _BOOT,
                 str(child_msgs.fileno()), str(child_fds.fileno())],
                pass_fds=(child_msgs.fileno(), child_fds.fileno()), env=env, stdin=subprocess.DEVNULL, cwd=cwd,
                # Its own session: a Ctrl-C at the terminal interrupts the training process,
                # which then waits for the save in flight, instead of also killing that save.
                start_new_session=True)
        finally:
            child_msgs.close()
            child_fds.close()
        self._conn = Connection(parent_msgs.detach())
        self._fds = parent_fds
        self._known = _ByIdentity()
        try:
            reply = self._receive(timeout, "start")
        except BaseException:
            self._discard()
            raise
        if reply[0] != "ready":
            self._discard()
            raise SaveWorkerError(f"gdsckpt save worker sent {reply[0]!r} instead of ready")

    def _receive(self, timeout: float, what: str, job: int | None = None) -> Any:
        """The worker's next answer. ``timeout`` bounds each silence, not the whole save: during
        a save the worker sends a heartbeat every ``POLL_SECONDS``, so a save that runs for
        longer than ``Config.timeout`` (a large state on slow storage) goes on, while a worker
        that is stopped or gone fails it (the save's own waits are bounded inside the worker,
        as in the training process)."""
        deadline = time.monotonic() + timeout
        assert self._conn is not None and self._process is not None
        process = self._process
        try:
            while True:
                while not self._conn.poll(POLL_SECONDS):
                    if process.poll() is not None and not self._conn.poll(0):
                        raise EOFError
                    if time.monotonic() > deadline:
                        self._discard()
                        raise SaveWorkerError(f"gdsckpt save worker gave no sign of life during the {what} "
                                              f"for {timeout} s (config timeout); it was stopped")
                reply = pickle.loads(self._conn.recv_bytes())
                if job is not None and reply == (job, "alive"):
                    deadline = time.monotonic() + timeout
                    continue
                return reply
        except (EOFError, OSError) as err:
            try:
                code = process.wait(timeout=POLL_SECONDS * 4)
            except subprocess.TimeoutExpired:
                code = None
            raise SaveWorkerError(f"gdsckpt save worker process (pid {process.pid}) exited with code {code} "
                                  f"during the {what}") from (None if isinstance(err, EOFError) else err)

    def _discard(self) -> None:
        """Stop the worker (if any) and forget it."""
        process, self._process = self._process, None
        for channel in (self._conn, self._fds):
            if channel is not None:
                try:
                    channel.close()
                except OSError:
                    pass
        self._conn = self._fds = None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def save(self, snapshot: Any, lent: list[tuple[tuple[str, int], Any]], path: str,
             options: dict[str, Any], timeout: float) -> Any:
        """``gdsckpt.save`` of ``snapshot`` (whose arrays live in the pooled buffers ``lent``) to
        ``path`` in the worker; the rename over ``path`` happens here. Returns the SaveReport."""
        with self._lock:
            try:
                self._ensure(timeout)
                report = self._save(snapshot, lent, path, options, timeout)
            except SaveWorkerError:
                self._discard()
                raise
        if is_url(path):
            return report
        config = options.get("config")
        config = config if config is not None else Config.from_env()
        publish(Path(report.path), Path(path), fsync=config.fsync, timeout=config.timeout)
        return dataclasses.replace(report, path=path)

    def _save(self, snapshot: Any, lent: list[tuple[tuple[str, int], Any]], path: str,
              options: dict[str, Any], timeout: float) -> Any:
        by_pointer: dict[int, int] = {}
        new_host: list[tuple[int, int, int, bool]] = []  # (id, bytes, memfd, page-locked)
        new_cuda: dict[int, Any] = {}
        # Buffers this message introduces become known only once the worker reports the save
        # done: a save that fails anywhere (its state does not pickle, the worker cannot map a
        # buffer, the save itself fails) leaves both sides as they were, where marking them known
        # at once left the next save naming a buffer the worker never mapped.
        introduced: dict[int, tuple[Any, int]] = {}  # id(root) -> (root, its new id)
        for (kind, _nbytes), buffer in lent:
            if kind == "numpy":
                continue  # NumPy arrays travel by value
            root, fd, pinned = buffer, -1, False
            if not kind.startswith("cuda"):
                fd, pinned, slab = _host_buffers[buffer]
                root = buffer if slab is None else slab
            bid = self._known.get(root)
            if bid is None and id(root) in introduced:
                bid = introduced[id(root)][1]
            if bid is None:
                bid = self._next_id
                self._next_id += 1
                if kind.startswith("cuda"):
                    new_cuda[bid] = root
                else:
                    new_host.append((bid, root.numel(), fd, pinned))
                introduced[id(root)] = (root, bid)
            by_pointer[root.untyped_storage().data_ptr()] = bid
        skeleton = io.BytesIO()
        _SnapshotPickler(skeleton, by_pointer).dump(snapshot)
        job = self._next_job
        self._next_job += 1
        live = sorted([*self._known.values(), *(bid for _root, bid in introduced.values())])
        message = pickle.dumps({
            "job": job, "host": [(bid, nbytes, pinned) for bid, nbytes, _fd, pinned in new_host],
            "cuda": _dumps_cuda(new_cuda) if new_cuda else None, "snapshot": skeleton.getvalue(),
            "live": live, "path": path, "options": options,
        }, protocol=pickle.HIGHEST_PROTOCOL)
        self._send(message, new_host, timeout)
        reply = self._receive(timeout, f"save to {path!r}", job=job)
        if reply[0] != job:
            raise SaveWorkerError(f"gdsckpt save worker answered job {reply[0]} instead of {job}")
        if reply[1] == "error":
            raise pickle.loads(reply[2])
        for root, bid in introduced.values():
            self._known[root] = bid
        return reply[2]

    def _send(self, message: bytes, new_host: list[tuple[int, int, int, bool]], timeout: float) -> None:
        """Send a save's message and its new buffers' descriptors. A worker that takes none of it
        (stopped, or stuck) is killed after ``timeout`` seconds, which ends the blocked send."""
        assert self._conn is not None and self._fds is not None and self._process is not None
        process = self._process
        stalled = threading.Event()

        def kill_stalled() -> None:
            stalled.set()
            if process.poll() is None:
                process.kill()

        watchdog = threading.Timer(timeout, kill_stalled)
        watchdog.daemon = True
        watchdog.start()
        try:
            # The message first: the worker reads it, then takes the descriptors one by one. The
            # other order deadlocks once the unsent descriptors fill the socket's buffer (a few
            # hundred arrays), the worker still waiting for the message.
            self._conn.send_bytes(message)
            for bid, _nbytes, fd, _pinned in new_host:
                socket.send_fds(self._fds, [bid.to_bytes(8, "little")], [fd])
        except OSError as err:
            if stalled.is_set():
                raise SaveWorkerError(f"gdsckpt save worker took no save within {timeout} s (config timeout); "
                                      f"it was stopped") from err
            raise SaveWorkerError(f"gdsckpt save worker is gone: {err}") from err
        finally:
            watchdog.cancel()

    def close(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit (after its current save) and wait up to ``timeout`` seconds,
        then stop it. A save still running after ``timeout`` seconds (one abandoned at
        interpreter exit) is stopped with its worker: its file is never renamed."""
        if not self._lock.acquire(timeout=timeout):
            process = self._process
            if process is not None and process.poll() is None:
                process.kill()  # the save's thread then fails with SaveWorkerError
            return
        try:
            process, conn = self._process, self._conn
            if process is not None and process.poll() is None and conn is not None:
                try:
                    conn.send_bytes(pickle.dumps({"exit": True}))
                    process.wait(timeout=timeout)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._discard()
        finally:
            self._lock.release()


# ---------------------------------------------------------------------------------------------
# the worker process

def _import_path() -> list[str]:
    """The caller's ``sys.path`` with '' (its working directory) spelled out; without it where
    that directory has been removed (it names nothing then, and ``os.getcwd`` fails)."""
    try:
        cwd: str | None = os.getcwd()
    except OSError:
        cwd = None
    return [entry or cwd for entry in sys.path if entry or cwd]  # type: ignore[misc]


def _warm_up_list() -> list[str]:
    """What the worker should load before its first save: the caller's loaded modules among
    ``_WARM_MODULES``, and ``cuda`` where the caller's torch has initialised CUDA."""
    names = [name for name in _WARM_MODULES if name in sys.modules]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        names.append("cuda")
    return names


def _warm_up(names: list[str]) -> None:
    import importlib

    for name in names:
        if name == "cuda":
            import torch

            torch.cuda.init()
        else:
            try:
                importlib.import_module(name)
            except ImportError:  # the save imports (and reports) what it needs
                pass


_SAVING = threading.Lock()
"""Held by the worker's main thread while a save runs (``_serve``): what ``_watch_parent`` stops,
and waits for, when the training process is gone."""

ABORT_SECONDS = 30.0
"""How long a worker whose training process is gone waits for its running save to abort before
it exits anyway."""


def _watch_parent(parent: int) -> None:
    """Exit as soon as the training process is gone: a save still running reads a snapshot that
    no longer exists, and its file is never renamed anyway. The save is first stopped as a ^C
    stops one, so that its writer aborts (a temporary file is removed), then ``_exit`` waits for
    an ``s3://`` upload's abort to reach the server. All within ``ABORT_SECONDS``."""
    while True:
        time.sleep(POLL_SECONDS)
        if os.getppid() != parent:
            deadline = time.monotonic() + ABORT_SECONDS
            if _SAVING.locked():
                # A real signal to the main thread (not ``interrupt_main``, which only sets a flag):
                # it also wakes a wait the main thread is blocked in.
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
                if _SAVING.acquire(timeout=ABORT_SECONDS):
                    _SAVING.release()
            _exit(3, deadline)


def _exit(code: int, deadline: float) -> None:
    """``os._exit(code)`` once the uploads this process aborted have ended, or at ``deadline``
    (``time.monotonic``): a save that failed returns before its upload's abort reached the server
    (its wait for that may be interrupted), and exiting at once left the upload's parts there,
    where no later save knows of them (``io.s3.settle_uploads``)."""
    s3 = sys.modules.get("gdsckpt.io.s3")  # loaded by a save to s3:// only
    if s3 is not None:
        s3.settle_uploads(max(0.0, deadline - time.monotonic()))
    os._exit(code)


def _receive_fds(fds: socket.socket, ids: list[int]) -> list[int]:
    """The descriptors of a message's new host buffers, all of them: a mapping that fails later
    must not leave descriptors in the socket for the next message to take as its own."""
    received: list[int] = []
    try:
        for bid in ids:
            data, got, _flags, _address = socket.recv_fds(fds, 8, 1)
            received.extend(got)
            if int.from_bytes(data, "little") != bid or len(got) != 1:
                raise SaveWorkerError(f"shared buffer {bid} did not arrive")
    except BaseException:
        for fd in received:
            os.close(fd)
        raise
    return received


def _map_host(fd: int, nbytes: int, pinned: bool) -> tuple[Any, int]:
    import torch

    mapping = mmap.mmap(fd, nbytes)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    pointer = buffer.data_ptr() if pinned and _register(buffer.data_ptr(), nbytes) else 0
    return buffer, pointer


class _Heartbeat:
    """Tells the parent, every ``POLL_SECONDS`` while a save runs, that this worker is alive:
    the parent's ``Config.timeout`` then bounds a silence, not the length of a save."""

    def __init__(self, send: Any, job: int):
        self._send, self._job = send, job
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gdsckpt-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self._send((self._job, "alive"))
            except OSError:
                return  # the parent is gone; the watcher thread ends this process

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _check_parent() -> None:
    """Refuse to publish a save whose snapshot's owner has died: its GPU buffers (CUDA IPC) may
    have been freed under the save's reads."""
    if os.getppid() != int(os.environ[_ENV_PARENT]):
        raise SaveWorkerError("the training process that owns this save's snapshot exited during the save")


def _serve(conn: Any, fds: socket.socket) -> None:
    from ..api import saving as api_saving
    from ..state import flatten

    send_lock = threading.Lock()

    def send(obj: Any) -> None:
        payload = pickle.dumps(obj)
        with send_lock:
            conn.send_bytes(payload)

    buffers: dict[int, tuple[Any, int]] = {}  # id -> (tensor, page-locked pointer or 0)
    send(("ready", os.getpid()))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if message.get("exit"):
            return
        job = message["job"]
        introduced: list[int] = [bid for bid, _nbytes, _pinned in message["host"]]
        heartbeat = _Heartbeat(send, job)
        try:
            received = _receive_fds(fds, introduced)
            try:
                for fd, (bid, nbytes, pinned) in zip(received, message["host"]):
                    buffers[bid] = _map_host(fd, nbytes, pinned)
            finally:
                for fd in received:  # a mapping keeps its own reference to the memory
                    os.close(fd)
            if message["cuda"] is not None:
                cuda = pickle.loads(message["cuda"])
                introduced.extend(cuda)
                buffers.update({bid: (t, 0) for bid, t in cuda.items()})
            for bid in set(buffers) - set(message["live"]):
                _unregister(buffers.pop(bid)[1])
            tensors = {bid: entry[0] for bid, entry in buffers.items()}
            snapshot = _SnapshotUnpickler(io.BytesIO(message["snapshot"]), tensors).load()
            # A file is left at a temporary path for the parent to rename; an s3:// object
            # becomes visible only when its upload completes, so the worker publishes it itself.
            with _SAVING:
                report = api_saving.save_flat(flatten(snapshot), message["path"], rename=is_url(message["path"]),
                                              before_commit=_check_parent, **message["options"])
            del snapshot, tensors
            reply: Any = (job, "ok", report)
        except BaseException as err:  # noqa: BLE001 - every error goes back to the caller
            # The parent counts a failed save's new buffers as unknown: forget them here too.
            for bid in introduced:
                entry = buffers.pop(bid, None)
                if entry is not None:
                    _unregister(entry[1])
            reply = (job, "error", _error_payload(err))
        finally:
            heartbeat.stop()
        send(reply)


def _leave_signals_to_the_parent(parent: int) -> None:
    """Ignore SIGTERM, and SIGINT while the training process lives: a job's scheduler signals
    every process of the job on a pre-emption (``scancel``, SLURM, Kubernetes), and the worker
    died of it with the save in flight, failing the ``wait()`` of the very handler that wanted
    that save. The training process decides: it waits for the save, or goes, and then
    ``_watch_parent`` stops the save with a SIGINT of its own, which this handler passes on as
    a ^C once the parent is gone."""
    def interrupt_once_the_parent_is_gone(_signum: int, _frame: Any) -> None:
        if os.getppid() != parent:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, interrupt_once_the_parent_is_gone)


def _main() -> None:
    """Entry point of the worker process (``python -c``; arguments: two socket descriptors)."""
    from multiprocessing.connection import Connection

    parent = int(os.environ[_ENV_PARENT])
    if os.getppid() != parent:
        os._exit(3)
    _leave_signals_to_the_parent(parent)
    threading.Thread(target=_watch_parent, args=(parent,), name="gdsckpt-watch-parent", daemon=True).start()
    conn = Connection(int(sys.argv[1]))
    fds = socket.socket(fileno=int(sys.argv[2]))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` shows where it is
    try:
        os.nice(WORKER_NICE)  # its threads (kvikio's, the pipeline's) inherit it
    except OSError:
        pass
    _warm_up([name for name in os.environ.get(_ENV_WARM, "").split(",") if name])
    try:
        _serve(conn, fds)
    except (OSError, KeyboardInterrupt):  # the parent's end gone (mid-message too); ^C: _watch_parent
        pass
    # Leave without interpreter teardown: CUDA IPC mappings and nvCOMP's allocator hooks have
    # been seen to crash at interpreter exit; everything durable is already on disk.
    _exit(0, time.monotonic() + ABORT_SECONDS)


__all__ = ["SaveWorker", "shared_host_buffer"]
