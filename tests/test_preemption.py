"""Pre-emption: a job's scheduler sends SIGTERM (or SIGUSR1) before it kills the job, and
training scripts install a handler that saves, waits for the saves in flight, and exits. Such a
handler runs in the main thread wherever the signal lands, possibly inside a gdsckpt call. Real
processes, real signals: each child places the signal at a chosen function of gdsckpt
(``_thread.interrupt_main`` from a profile hook, exactly where a scheduler's signal may land),
and its handler calls gdsckpt again. A call that would wait for the frame it interrupted (a lock
that frame holds, a save it has not started yet) raises a ``RuntimeError`` saying so instead of
hanging; one that can go on does; and the checkpoints on disk stay restorable either way."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

HANDLER_CHILD = textwrap.dedent(r'''
    import _thread, os, signal, sys, torch, gdsckpt
    where, what, directory = sys.argv[1], sys.argv[2], sys.argv[3]
    manager = gdsckpt.CheckpointManager(directory, keep_last=2)
    def state(step):
        return {"w": torch.full((1000,), float(step)), "step": step}
    fired = []
    def place_the_signal(frame, event, _arg):
        if event == "call" and frame.f_code.co_name == where and not fired:
            fired.append(1)
            _thread.interrupt_main(signal.SIGTERM)
    def on_term(_signum, _frame):
        sys.setprofile(None)
        try:
            if what == "manager.save":
                manager.save(99, state(99))
            elif what == "manager.wait":
                manager.wait()
                manager.save(99, state(99))
            elif what == "gdsckpt.wait_all":
                gdsckpt.wait_all()
                manager.save(99, state(99))
            elif what == "manager.save_async":
                manager.save_async(99, state(99)).wait()
            elif what == "gdsckpt.save":
                gdsckpt.save(state(99), os.path.join(directory, "emergency.gdsckpt"))
            print("HANDLER_SAVED", flush=True)
        except RuntimeError as err:
            print("HANDLER_REFUSED", err, flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    first = manager.save_async if what in ("manager.wait", "gdsckpt.wait_all", "manager.save_async") else manager.save
    result = first(1, state(1))
    if hasattr(result, "wait"):
        result.wait()
    sys.setprofile(place_the_signal)
    result = first(2, state(2))
    sys.setprofile(None)
    print("NO_SIGNAL", flush=True)
''')


def _restored_step(directory: Path) -> int:
    """The step of the checkpoint a restore of ``directory`` takes, whose content must be that
    step's state, bit for bit."""
    import torch

    import gdsckpt

    manager = gdsckpt.CheckpointManager(directory)
    step = manager.latest_step()
    assert step is not None
    loaded = gdsckpt.load(manager.path(step))
    assert loaded["step"] == step
    assert torch.equal(loaded["w"].view(torch.int32), torch.full((1000,), float(step)).view(torch.int32))
    return step


@pytest.mark.parametrize(("where", "what", "outcome"), [
    # the interrupted save holds the manager's lock while it moves `latest` (then prunes)
    ("_write_pointer", "manager.save", "HANDLER_REFUSED"),
    # the interrupted save_async has its slot and its place in flight, not yet its thread
    ("take_snapshot", "manager.wait", "HANDLER_SAVED"),
    ("take_snapshot", "gdsckpt.wait_all", "HANDLER_SAVED"),
    ("take_snapshot", "manager.save_async", "HANDLER_REFUSED"),
    # the interrupted save is inside the bookkeeping of the operations in flight (its lock held)
    ("_blocking", "gdsckpt.save", "HANDLER_REFUSED"),
], ids=["manager.save-in-publish", "wait-in-save_async", "wait_all-in-save_async", "save_async-in-save_async",
        "save-in-inflight-bookkeeping"])
def test_a_signal_handler_calling_gdsckpt_inside_a_gdsckpt_call_never_waits_for_itself(
        tmp_path: Path, h: Any, where: str, what: str, outcome: str) -> None:
    """These hung for ever (or for ``Config.timeout``, 600 s, waiting for a slot); the child is
    given 60 s here."""
    done = h.run_python("-c", HANDLER_CHILD, where, what, str(tmp_path), timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "NO_SIGNAL" not in done.stdout, "the signal did not land where the test placed it"
    assert outcome in done.stdout, done.stdout + done.stderr
    if outcome == "HANDLER_REFUSED":
        assert "signal handler" in done.stdout and "set a flag" in done.stdout
    # what the handler saved, else the newest checkpoint the interrupted call left complete
    assert _restored_step(tmp_path) in ({99} if outcome == "HANDLER_SAVED" else {1, 2})


WORKER_CHILD = textwrap.dedent(r'''
    import os, signal, sys, time, torch, gdsckpt
    directory = sys.argv[1]
    manager = gdsckpt.CheckpointManager(directory, keep_last=2,
                                        config=gdsckpt.Config(async_worker="process", timeout=60))
    state = {"w": torch.randn(16 << 20, generator=torch.Generator().manual_seed(5)), "step": 1}
    def on_term(_signum, _frame):
        try:
            manager.wait()
            print("WAIT_OK", manager.latest_step(), flush=True)
        except Exception as err:
            print("WAIT_RAISED", type(err).__name__, err, flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    manager.prepare(state)  # the worker process runs from here on
    workers = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
    assert workers, "no worker process"
    manager.save_async(1, state)
    for pid in workers:  # the scheduler signals every process of the job
        os.kill(int(pid), signal.SIGTERM)
        os.kill(int(pid), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
''')


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc to find the worker process")
def test_the_save_worker_process_survives_a_job_wide_sigterm_and_sigint(tmp_path: Path, h: Any) -> None:
    """``scancel`` signals the worker too: it died of it with the save in flight, and the
    handler's ``wait()`` failed with ``SaveWorkerError`` (its temporary left behind). The worker
    leaves the decision to the training process, which here waits for the save."""
    done = h.run_python("-c", WORKER_CHILD, str(tmp_path), timeout=120)
    assert "WAIT_OK 1" in done.stdout, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-0000000001.gdsckpt"]
    import torch

    import gdsckpt

    loaded = gdsckpt.load(tmp_path / "step-0000000001.gdsckpt")
    expected = torch.randn(16 << 20, generator=torch.Generator().manual_seed(5))
    assert torch.equal(loaded["w"].view(torch.int32), expected.view(torch.int32))


IN_FLIGHT_CHILD = textwrap.dedent(r'''
    import _thread, os, signal, sys, threading, time, torch, gdsckpt
    from gdsckpt.background import async_save
    where, main_call, what, directory = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    manager = gdsckpt.CheckpointManager(directory, keep_last=3)
    def state(step):
        return {"w": torch.full((1000,), float(step)), "step": step}
    def slow_disk(frame, event, _arg):  # the background save of step 1 takes 1.5 s
        if event == "call" and frame.f_code.co_name == "save_flat" and \
                threading.current_thread().name == "gdsckpt-async-save":
            time.sleep(1.5)
    threading.setprofile(slow_disk)
    first = manager.save_async(1, state(1))
    threading.setprofile(None)
    def on_term(_signum, _frame):
        sys.setprofile(None)
        try:
            {"manager.wait": manager.wait, "gdsckpt.wait_all": gdsckpt.wait_all, "handle.wait": first.wait}[what]()
            print("HANDLER_WAITED", first.done(), flush=True)
        except RuntimeError as err:
            print("HANDLER_REFUSED", err, flush=True)
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)
    if where == "registry":  # this thread inside the registry of errors (a comprehension runs there)
        with async_save._registry_lock:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
    fired = []
    def place_the_signal(frame, event, _arg):
        if event == "call" and frame.f_code.co_name == where and not fired:
            fired.append(1)
            _thread.interrupt_main(signal.SIGTERM)
    sys.setprofile(place_the_signal)
    getattr(manager, main_call)(2, state(2))
    sys.setprofile(None)
    print("NO_SIGNAL", flush=True)
''')


@pytest.mark.parametrize(("where", "main_call"), [
    ("_blocking", "save"),  # the bookkeeping of the saves in flight, which the first save's end takes
    ("_write_pointer", "save"),  # the manager's lock, which the first save's hooks take
    ("_identity", "save_async"),
    ("registry", "save"),  # the registry of background errors, which a failed save's end takes
], ids=["inflight-bookkeeping", "manager-publishing", "manager-begin", "error-registry"])
@pytest.mark.parametrize("what", ["manager.wait", "gdsckpt.wait_all", "handle.wait"])
def test_a_handler_waiting_for_a_background_save_whose_end_needs_a_lock_this_thread_holds_is_refused(
        tmp_path: Path, h: Any, where: str, main_call: str, what: str) -> None:
    """A save in flight (a slow disk) ends by taking locks this thread holds while the signal's
    handler runs: waiting for it waited for ever. The handler is told why instead."""
    done = h.run_python("-c", IN_FLIGHT_CHILD, where, main_call, what, str(tmp_path), timeout=60)
    assert "NO_SIGNAL" not in done.stdout, "the signal did not land where the test placed it"
    assert "HANDLER_REFUSED" in done.stdout and "set a flag" in done.stdout, done.stdout + done.stderr
    import gdsckpt

    if gdsckpt.CheckpointManager(tmp_path).latest_step() is not None:  # the handler exits at once
        assert _restored_step(tmp_path) in {1, 2}


LATE_THREAD_CHILD = textwrap.dedent(r'''
    import sys, threading, time, torch, gdsckpt
    directory, case = sys.argv[1], sys.argv[2]
    manager = gdsckpt.CheckpointManager(directory, keep_last=5, max_inflight=2)
    state = {"w": torch.zeros(1000), "step": 1}
    def late_thread(frame, event, _arg):  # the new thread is descheduled before its first line
        if event == "call" and frame.f_code.co_name == "_run" and \
                threading.current_thread().name == "gdsckpt-async-save":
            time.sleep(0.5)
    threading.setprofile(late_thread)
    handle = manager.save_async(1, state)
    if case == "wait":
        manager.wait()
        print("AFTER_WAIT", handle.done(), manager.latest_step(), flush=True)
    else:
        manager.save_async(2, {"w": torch.zeros(1000), "step": 2})
        print("SECOND_STARTED", flush=True)
    manager.wait()
''')


@pytest.mark.parametrize("case", ["wait", "second"])
def test_a_save_async_whose_thread_has_not_run_yet_is_waited_for_and_not_mistaken_for_a_handler(
        tmp_path: Path, h: Any, case: str) -> None:
    """No signal: the caller's thread counted as the job's starter until the job's thread ran
    its first line, so a ``wait()`` right after ``save_async`` returned without waiting, and a
    second ``save_async`` was refused as if from a signal handler."""
    done = h.run_python("-c", LATE_THREAD_CHILD, str(tmp_path), case, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("AFTER_WAIT True 1" if case == "wait" else "SECOND_STARTED") in done.stdout, done.stdout + done.stderr
