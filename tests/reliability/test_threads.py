"""Threads: saves and loads reuse process-wide worker threads, and never hang starting one.

Every save used to start new codec and I/O threads. Under a tight address-space limit
(``RLIMIT_AS``) a second save then blocked forever in CPython's ``Thread.start`` (a thread given a
cached stack died of a MemoryError before reporting that it ran). Now the threads are started
once, with a bounded handshake, and reused: later operations start none, each still runs at most
its configured number of tasks at once, and a thread that cannot be started is a ``RuntimeError``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

import gdsckpt
from gdsckpt.io.pools import Lane

from .harness import record_figure

HANG_GUARD = 90  # seconds; a child finishes in about 2 s, a hang is what this bounds


def _config(threads: int = 3) -> gdsckpt.Config:
    return gdsckpt.Config(chunk_bytes="64KiB", codec_threads=threads, io_threads=threads, timeout=60)


def _state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(200_000).astype(np.float32)
    weights[:3] = [np.float32("nan"), -0.0, np.inf]
    weights.view(np.uint32)[3] = 0x7FC0_1234  # a NaN with a payload
    return {"w": weights, "ids": rng.integers(0, 1000, 50_000, dtype=np.int64), "step": seed}


def _assert_bit_exact(expected: dict[str, Any], loaded: dict[str, Any]) -> None:
    for key in ("w", "ids"):
        assert loaded[key].dtype == expected[key].dtype, key
        assert loaded[key].tobytes() == expected[key].tobytes(), key
    assert loaded["step"] == expected["step"]


def _os_threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def test_later_saves_and_loads_start_no_threads(tmp_path: Path) -> None:
    seen: list[set[str]] = []

    def watch(_done: int, _total: int) -> None:  # runs while the operation's workers are busy
        seen[-1] |= _os_threads()

    for round_ in range(5):
        seen.append(_os_threads())
        state = _state(round_)
        gdsckpt.save(state, tmp_path / "ckpt.gdsckpt", config=_config(), progress=watch)
        _assert_bit_exact(state, gdsckpt.load(tmp_path / "ckpt.gdsckpt", config=_config(), progress=watch))
    new_threads = [sorted(seen[k] - set().union(*seen[:k])) for k in range(1, 5)]
    assert new_threads == [[], [], [], []], f"threads started by saves and loads 2-5: {new_threads}"
    record_figure("threads reused", f"5 saves and loads: {len(seen[0])} OS threads during the first, "
                                    f"0 new threads in the 4 after it")


def test_concurrent_saves_from_threads_are_bit_exact(tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def save_and_check(writer: int) -> None:
        try:
            for round_ in range(3):  # a full save, then deltas against the previous round
                state = _state(10 * writer + round_)
                path = tmp_path / f"w{writer}-{round_}.gdsckpt"
                base = tmp_path / f"w{writer}-{round_ - 1}.gdsckpt" if round_ else None
                gdsckpt.save(state, path, config=_config(2), base=base)
                _assert_bit_exact(state, gdsckpt.load(path, config=_config(2)))
        except BaseException as err:
            errors.append(err)

    writers = [threading.Thread(target=save_and_check, args=(i,)) for i in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(HANG_GUARD)
    assert not any(writer.is_alive() for writer in writers), "a concurrent save hung"
    assert not errors, errors


def test_delta_save_restoring_its_base_in_a_codec_task_does_not_wait_for_a_thread(tmp_path: Path) -> None:
    # Each codec task of a delta save restores base bytes through lanes of the same shared pools
    # and waits for them: with one thread per pool shared by both, that wait would never end.
    config = gdsckpt.Config(chunk_bytes="64KiB", codec_threads=1, io_threads=1, timeout=30)
    base, state = _state(1), _state(2)
    gdsckpt.save(base, tmp_path / "base.gdsckpt", config=config)
    gdsckpt.save(state, tmp_path / "delta.gdsckpt", config=config, base=tmp_path / "base.gdsckpt")
    _assert_bit_exact(state, gdsckpt.load(tmp_path / "delta.gdsckpt", config=config))


def test_a_lane_runs_at_most_its_thread_count_in_a_bigger_pool() -> None:
    wide = Lane("codec", 6)  # grows the shared pool to at least 6 threads
    narrow = Lane("codec", 2)
    lock = threading.Condition()
    running, most, go = 0, 0, threading.Event()

    def task(number: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
            lock.notify_all()
        go.wait(HANG_GUARD)
        with lock:
            running -= 1
        return number

    try:
        futures = [narrow.submit(task, n) for n in range(12)]
        with lock:
            assert lock.wait_for(lambda: running == 2, HANG_GUARD)
        go.set()
        assert [f.result(HANG_GUARD) for f in futures] == list(range(12))
        assert most == 2, f"{most} tasks of a 2-thread lane ran at once"
    finally:
        go.set()
        assert narrow.close(HANG_GUARD) and wide.close(HANG_GUARD)


def test_an_idle_worker_keeps_nothing_of_its_last_task() -> None:
    """A task's arguments and result (a read's buffer, a chunk's bytes) go once the caller drops
    its future: the pool's threads live as long as the process, so one holding its last task would
    keep that memory allocated outside every bound until its next task."""
    import weakref

    class Buffer:
        pass

    lane = Lane("io", 2)
    gone = []
    try:
        for _ in range(4):
            buffer = Buffer()
            gone.append(threading.Event())
            weakref.finalize(buffer, gone[-1].set)
            future = lane.submit(lambda b: b, buffer)
            assert future.result(HANG_GUARD) is buffer
            del future, buffer
        deadline = time.monotonic() + 10  # the worker drops it right after settling the future
        for event in gone:
            assert event.wait(max(0.0, deadline - time.monotonic())), "a worker still holds a finished task"
    finally:
        assert lane.close(HANG_GUARD)


def test_a_forked_child_starts_pools_of_its_own(tmp_path: Path) -> None:
    # The parent's workers do not exist in a forked child: a child that believed it had them
    # would queue its tasks for nobody (then fail after Config.timeout).
    gdsckpt.save(_state(1), tmp_path / "parent.gdsckpt", config=_config())
    inherited = Lane("io", 2)
    assert inherited.submit(pow, 2, 5).result(HANG_GUARD) == 32

    def child() -> bool:
        state = _state(2)
        config = gdsckpt.Config(chunk_bytes="64KiB", codec_threads=3, io_threads=3, timeout=20)
        gdsckpt.save(state, tmp_path / "child.gdsckpt", config=config)
        _assert_bit_exact(state, gdsckpt.load(tmp_path / "child.gdsckpt", config=config))
        return bool(inherited.submit(pow, 3, 2).result(20) == 9)

    assert _in_forked_child(child, HANG_GUARD) == 0
    assert inherited.close(HANG_GUARD)


def _in_forked_child(call: Any, guard: float) -> int:
    """Fork; the child runs ``call`` and exits 0 where it returned True (1 where it raised, 2
    where it returned False); the parent waits at most ``guard`` seconds and returns the child's
    exit code (``AssertionError`` naming a hang, after killing it, where it did not end)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: fork of a threaded process
        # JAX, where installed and imported by another test, warns from its own at-fork hook that
        # its threads do not survive a fork; this child never touches JAX.
        warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
        pid = os.fork()
    if pid == 0:  # the child: report through the exit status, never return into pytest
        code = 1
        try:
            code = 0 if call() else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + guard
    while (waited := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the forked child did not finish within {guard} s")
        time.sleep(0.05)
    return os.waitstatus_to_exitcode(waited[1])


class _HeldInAThread:
    """A thread of this process waits inside ``hold`` (a function the test arranges to be called
    with a library lock held) until released: a fork meanwhile copies that lock held."""

    def __init__(self, start: Any) -> None:
        self.inside, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=start, daemon=True)

    def hold(self) -> None:
        if threading.current_thread() is self.thread:
            self.inside.set()
            assert self.release.wait(HANG_GUARD)

    def __enter__(self) -> _HeldInAThread:
        self.thread.start()
        assert self.inside.wait(HANG_GUARD)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.thread.join(HANG_GUARD)


def test_a_child_forked_while_a_thread_opens_a_deltas_base_reads_deltas(tmp_path: Path,
                                                                       monkeypatch: Any) -> None:
    """The module lock around opening a delta's base was copied held into a child forked while
    another thread opened one: the child's next delta read waited for good."""
    from gdsckpt.api import checkpoint as checkpoint_module

    base, delta = tmp_path / "base.gdsckpt", tmp_path / "delta.gdsckpt"
    state = _state(3)
    gdsckpt.save(state, base, config=_config())
    state["w"][:10] += 1
    gdsckpt.save(state, delta, base=base, config=_config())
    real_open_base = checkpoint_module.open_base

    def open_base(*args: Any, **kwargs: Any) -> Any:
        held.hold()  # with the lock held
        return real_open_base(*args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "open_base", open_base)
    held = _HeldInAThread(lambda: gdsckpt.load(delta, config=_config()))
    with held:
        code = _in_forked_child(lambda: _assert_bit_exact(state, gdsckpt.load(delta, config=_config())) or True,
                                20)
    assert code == 0


def test_a_child_forked_during_a_storage_probe_saves_with_auto(tmp_path: Path, monkeypatch: Any) -> None:
    """The per-storage probe lock of codec auto was copied held into a child forked during
    another thread's probe: the child's first auto save that weighed the storage waited for good
    (and a thread waiting for another's probe had no bound)."""
    from gdsckpt.pipeline import autotune

    def probe(directory: Path, nbytes: int | None = None, timeout: float | None = None) -> float:
        held.hold()
        return 1.0

    monkeypatch.setattr(autotune, "measure_storage_gbps", probe)
    held = _HeldInAThread(lambda: autotune.storage_gbps(tmp_path))
    with held:
        assert _in_forked_child(lambda: autotune.storage_gbps(tmp_path) == 1.0, 20) == 0
        # in this process, a second caller waits for the running probe at most its timeout
        started = time.monotonic()
        assert autotune.storage_gbps(tmp_path, timeout=0.2) is None
        assert time.monotonic() - started < 10


def test_a_child_forked_while_a_thread_makes_a_tensors_byte_view_loads_torch(tmp_path: Path,
                                                                            monkeypatch: Any) -> None:
    """``functools.cached_property`` (before Python 3.12) holds one lock for every instance
    while a value is made: a child forked while a restore thread made a tensor's byte view
    waited for good at its own next torch load."""
    import torch

    from gdsckpt.state import arrays

    path = tmp_path / "t.gdsckpt"
    state = {"w": torch.arange(50_000, dtype=torch.float32)}
    expected = state["w"].numpy().tobytes()
    gdsckpt.save(state, path, config=_config())
    real_byte_view = arrays._byte_view

    def byte_view(tensor: Any) -> Any:
        held.hold()
        return real_byte_view(tensor)

    monkeypatch.setattr(arrays, "_byte_view", byte_view)
    held = _HeldInAThread(lambda: gdsckpt.load(path, config=_config()))
    with held:
        # bytes compared in NumPy: torch's own parallel kernels are not for a forked child
        code = _in_forked_child(lambda: gdsckpt.load(path, config=_config())["w"].numpy().tobytes() == expected, 20)
    assert code == 0


_CHILD = textwrap.dedent("""
    import hashlib, resource, sys
    import numpy as np
    import gdsckpt

    path, grow = sys.argv[1], sys.argv[2] == "grow"
    config = gdsckpt.Config(chunk_bytes="64KiB", codec_threads=2, io_threads=2, timeout=60)
    state = {"w": np.arange(300_000, dtype=np.float32)}
    gdsckpt.save(state, path, config=config)
    with open("/proc/self/status") as status:
        vm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    # No more address space than the process holds after one save: no room for a new thread's
    # stack, and only what the first save freed for the next saves' buffers.
    resource.setrlimit(resource.RLIMIT_AS, (vm_kib * 1024, resource.RLIM_INFINITY))
    if grow:
        config = gdsckpt.Config(chunk_bytes="64KiB", codec_threads=64, io_threads=2, timeout=60)
    try:
        for step in (1, 2, 3):
            state["w"][0] = step
            gdsckpt.save(state, path, config=config)
            print("saved", step, flush=True)
            loaded = gdsckpt.load(path, config=config)["w"]
            assert hashlib.sha256(loaded).digest() == hashlib.sha256(state["w"]).digest()
    except (RuntimeError, MemoryError) as err:
        print("error", type(err).__name__, err, flush=True)
    else:
        print("done", flush=True)
""")


def _run_limited(tmp_path: Path, mode: str) -> list[str]:
    """Run the child under its address-space limit; returns its output lines, after checking
    that the checkpoint at its path is the last one it reported saved, bit-exact."""
    path = tmp_path / "limited.gdsckpt"
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(path), mode], capture_output=True,
                              text=True, timeout=HANG_GUARD, env=os.environ.copy())
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"a save under an address-space limit hung for {HANG_GUARD} s") from err
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    saved = [int(line.split()[1]) for line in lines if line.startswith("saved")]
    expected = np.arange(300_000, dtype=np.float32)
    expected[0] = saved[-1] if saved else 0
    assert gdsckpt.load(path)["w"].tobytes() == expected.tobytes()
    return lines


def test_saves_under_an_address_space_limit_finish_or_fail_clearly(tmp_path: Path) -> None:
    lines = _run_limited(tmp_path, "same")
    assert lines[0] == "saved 1", lines  # the process's second save reuses the first one's threads
    # Later buffers may not fit in the limit: a MemoryError then, never a hang.
    assert lines[-1] == "done" or lines[-1].startswith("error MemoryError"), lines
    record_figure("saves under RLIMIT_AS", f"limit = address space after one save: {', '.join(lines)}")


def test_a_thread_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    lines = _run_limited(tmp_path, "grow")
    assert lines == [lines[-1]], lines  # the first save that needs more threads fails, at its start
    assert lines[-1].startswith("error RuntimeError cannot start gdsckpt-codec worker"), lines
    assert "ulimit -v" in lines[-1]


def test_a_child_forked_while_a_manager_writes_its_pointer_saves(tmp_path: Path, monkeypatch: Any) -> None:
    """A manager's own lock, held by its background save while it wrote ``latest`` and pruned,
    was copied held into a child forked then: the child's next save of that manager waited for
    good."""
    from gdsckpt import manager as manager_module

    directory = tmp_path / "run"
    manager = gdsckpt.CheckpointManager(directory, keep_last=2, config=_config())
    manager.save(1, _state(1))
    real_write_pointer = manager_module.CheckpointManager._write_pointer

    def write_pointer(self: Any, step: int, epoch: int) -> None:
        held.hold()  # under the manager's lock
        real_write_pointer(self, step, epoch)

    monkeypatch.setattr(manager_module.CheckpointManager, "_write_pointer", write_pointer)
    held = _HeldInAThread(lambda: manager.save(2, _state(2)))

    def child() -> bool:
        manager.save(3, _state(3))
        return gdsckpt.load(manager.path(3), config=_config())["step"] == 3

    with held:
        code = _in_forked_child(child, 20)
    assert code == 0
