"""``gdsckpt.CheckpointManager``: numbered checkpoints, the ``latest`` pointer, pruning, restore of
the newest complete checkpoint (skipping damaged ones), and a training process killed with
SIGKILL at random moments that always resumes bit-exact."""

from __future__ import annotations

import errno
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Any

import pytest
import torch

import gdsckpt
from gdsckpt import CheckpointManager, SkippedCheckpointWarning
from gdsckpt.demo import bit_equal, train_steps, training_state
from gdsckpt.io import posix

TEMP_MARKER = ".gdsckpt-tmp-"


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _ckpt(step: int) -> str:
    return f"step-{step:010d}.gdsckpt"


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(2000, generator=g), "b": torch.randn(10, generator=g), "step": step,
            "note": f"step {step}"}


@pytest.fixture
def config(h: Any) -> gdsckpt.Config:
    return h.small_config()


# ---------------------------------------------------------------------------------------------
# saving, pointer, pruning

def test_save_names_points_and_prunes(tmp_path: Path, config: gdsckpt.Config) -> None:
    manager = CheckpointManager(tmp_path / "run", keep_last=2, config=config)
    assert manager.steps() == [] and manager.latest_step() is None
    for step in (1, 2, 3, 10):
        report = manager.save(step, _state(step))
        assert report.path == str(tmp_path / "run" / _ckpt(step))
        assert (tmp_path / "run" / "latest").read_text() == _ckpt(step) + "\n"
    assert manager.steps() == [3, 10] and manager.latest_step() == 10
    assert _names(tmp_path / "run") == ["latest", _ckpt(3), _ckpt(10)]
    with pytest.raises(ValueError, match="step"):
        manager.save(-1, _state(1))
    with pytest.raises(TypeError, match="dict"):
        manager.save(11, [torch.ones(1)])  # type: ignore[arg-type]
    assert manager.steps() == [3, 10]


def test_keep_all_and_bad_arguments(tmp_path: Path, config: gdsckpt.Config) -> None:
    manager = CheckpointManager(tmp_path, keep_last=None, prefix="epoch", config=config)
    for step in range(4):
        manager.save(step, _state(step))
    assert manager.steps() == [0, 1, 2, 3]
    assert (tmp_path / "epoch-0000000003.gdsckpt").exists()
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="keep_last"):
            CheckpointManager(tmp_path, keep_last=bad)  # type: ignore[arg-type]
    for prefix in ("", ".hidden", "a/b", "latest"):
        with pytest.raises(ValueError, match="prefix"):
            CheckpointManager(tmp_path, prefix=prefix)


def test_save_async_moves_latest_and_prunes_when_complete(tmp_path: Path, config: gdsckpt.Config) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2, config=config)
    state = _state(0)
    for step in range(1, 6):
        state["step"] = step
        handle = manager.save_async(step, state)
        with torch.no_grad():
            state["w"].add_(1)  # the snapshot was taken: this lands in the next checkpoint
        handle.wait(timeout=60)
        assert manager.latest_step() == step  # pointer and pruning are done when wait() returns
    assert manager.steps() == [4, 5]
    stats = manager.pool_stats()
    assert stats.allocations == 2 and stats.reuses == 8, stats  # "w" and "b", allocated once
    loaded = gdsckpt.load(manager.path(5))
    expected = _state(0)["w"]
    for _ in range(4):
        expected.add_(1)
    assert loaded["step"] == 5 and bit_equal(loaded["w"], expected)


def test_failed_save_prunes_nothing_and_keeps_latest(tmp_path: Path, config: gdsckpt.Config,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    manager = CheckpointManager(tmp_path, keep_last=1, config=config)
    manager.save(1, _state(1))

    def no_space(fd: int, data: Any, offset: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(posix, "pwrite_all", no_space)
    with pytest.raises(OSError) as caught:
        manager.save_async(2, _state(2)).wait(timeout=60)
    assert caught.value.errno == errno.ENOSPC
    with pytest.raises(OSError):
        manager.save(2, _state(2))
    assert _names(tmp_path) == ["latest", _ckpt(1)]
    assert manager.latest_step() == 1


def test_pruning_spares_the_checkpoint_being_written(tmp_path: Path, config: gdsckpt.Config,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """keep_last=1. Step 5 is saved again (say, after resuming from step 4) and held inside its
    write while step 6 completes: pruning after step 6 must leave step 5's file alone."""
    manager = CheckpointManager(tmp_path, keep_last=1, config=config)
    manager.save(5, _state(5))
    entered, release = threading.Event(), threading.Event()
    commit = posix.PosixWriter.commit

    def held_commit(self: Any) -> None:
        if self.target.name == _ckpt(5):
            entered.set()
            assert release.wait(60)
        commit(self)

    monkeypatch.setattr(posix.PosixWriter, "commit", held_commit)
    handle = manager.save_async(5, _state(55))
    assert entered.wait(60)
    manager.save(6, _state(6))
    assert [n for n in _names(tmp_path) if not n.startswith(".")] == ["latest", _ckpt(5), _ckpt(6)], \
        "pruned the checkpoint being written"
    assert manager.latest_step() == 6
    release.set()
    handle.wait(timeout=60)
    # step 5 finished after step 6: latest stays at 6, and 5 is pruned now
    assert (tmp_path / "latest").read_text() == _ckpt(6) + "\n"
    assert manager.steps() == [6]


def test_pruning_spares_the_latest_complete_checkpoint(tmp_path: Path, config: gdsckpt.Config) -> None:
    """A run restarted from an older step: the checkpoint it just completed is kept whatever
    keep_last says, although higher-numbered files of the abandoned run exist."""
    first = CheckpointManager(tmp_path, keep_last=3, config=config)
    for step in (3, 4, 5):
        first.save(step, _state(step))
    second = CheckpointManager(tmp_path, keep_last=1, config=config)
    second.save(2, _state(2))
    assert (tmp_path / "latest").read_text().splitlines()[0] == _ckpt(2)  # then the steps it supersedes
    assert second.steps() == [2, 5]  # latest (2) and the newest by step (5)
    step, extra = second.restore_latest()  # type: ignore[misc]
    assert step == 2 and extra["note"] == "step 2"


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path: Path, config: gdsckpt.Config) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [tmp_path / f".{_ckpt(7)}{TEMP_MARKER}{dead.pid}-0000",
             tmp_path / f".latest{TEMP_MARKER}{dead.pid}-0001"]
    from gdsckpt.io import posix

    mine = tmp_path / f".{_ckpt(8)}{TEMP_MARKER}{os.getpid()}-{posix._process_token}0002"  # this process's: kept
    for path in stale + [mine]:
        path.write_bytes(b"partial")
    (tmp_path / "unrelated.txt").write_text("x")
    CheckpointManager(tmp_path, config=config)
    assert _names(tmp_path) == sorted([mine.name, "unrelated.txt"])


# ---------------------------------------------------------------------------------------------
# restore

def test_restore_contract(tmp_path: Path, config: gdsckpt.Config) -> None:
    manager = CheckpointManager(tmp_path, config=config)
    model, optimizer = training_state(width=32, depth=1, steps=0)
    assert manager.restore_latest(model=model, optimizer=optimizer) is None  # nothing yet

    train_steps(model, optimizer, 2, seed=3)
    rng = torch.get_rng_state()
    manager.save_async(2, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng,
                           "data": {"epoch": 1, "position": 64}, "loss": 0.25})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    train_steps(model, optimizer, 1, seed=4)
    manager.wait(timeout=60)

    fresh, fresh_optimizer = training_state(width=32, depth=1, steps=0, seed=9)
    step, extra = manager.restore_latest(model=fresh, optimizer=fresh_optimizer)  # type: ignore[misc]
    assert step == 2
    assert sorted(extra) == ["data", "loss", "rng"]
    assert extra["data"] == {"epoch": 1, "position": 64} and extra["loss"] == 0.25
    assert bit_equal(extra["rng"], rng)
    assert all(bit_equal(expected[k], v) for k, v in fresh.state_dict().items())
    assert fresh_optimizer.state_dict()["state"][0]["step"].item() == 2

    # state=: tensors filled in place, top-level plain values replaced, the rest returned
    data = {"epoch": 0, "position": 0}
    target = {"rng": torch.empty_like(rng), "data": data, "loss": 0.0}
    step, extra = manager.restore_latest(model=fresh, state=target)  # type: ignore[misc]
    assert step == 2 and sorted(extra) == ["optimizer"]
    assert bit_equal(target["rng"], rng) and target["loss"] == 0.25
    assert target["data"] is data and data == {"epoch": 1, "position": 64}

    # no target: the whole checkpoint
    step, everything = manager.restore_latest()  # type: ignore[misc]
    assert sorted(everything) == ["data", "loss", "model", "optimizer", "rng"]

    # a target that does not fit is the caller's mistake, not damage: raised, nothing skipped
    other, _ = training_state(width=64, depth=1, steps=0)
    with pytest.raises(gdsckpt.StateMismatchError):
        manager.restore_latest(model=other)
    with pytest.raises(gdsckpt.StateMismatchError):
        manager.restore_latest(state={"missing": torch.zeros(1)})


def test_restore_raises_what_is_not_damage(three: CheckpointManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """A codec this machine lacks would fail on every older checkpoint too: raised, not skipped
    (silently restarting from scratch would be worse)."""
    def no_codec(*args: Any, **kwargs: Any) -> Any:
        raise gdsckpt.CodecUnavailableError("nvcomp.ans/1 needs a GPU (injected)")

    monkeypatch.setattr(gdsckpt.api, "load_into", no_codec)
    with pytest.raises(gdsckpt.CodecUnavailableError, match="injected"):
        three.restore_latest(state={"w": torch.zeros(2000)})


@pytest.fixture
def three(tmp_path: Path, config: gdsckpt.Config) -> CheckpointManager:
    manager = CheckpointManager(tmp_path, keep_last=3, config=config)
    for step in (1, 2, 3):
        manager.save(step, _state(step))
    return manager


def _restore_and_check(manager: CheckpointManager, expected_step: int, **kwargs: Any) -> None:
    target = {"w": torch.zeros(2000), "b": torch.zeros(10)}
    restored = manager.restore_latest(state=target, **kwargs)
    assert restored is not None
    step, extra = restored
    assert step == expected_step and extra == {"step": expected_step, "note": f"step {expected_step}"}
    expected = _state(expected_step)
    assert bit_equal(target["w"], expected["w"]) and bit_equal(target["b"], expected["b"])


def test_truncated_newest_checkpoint_is_skipped_with_a_warning(three: CheckpointManager) -> None:
    path = three.path(3)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.warns(SkippedCheckpointWarning, match=f"{_ckpt(3)}.*named by latest") as record:
        _restore_and_check(three, 2)
    assert len(record) == 1
    assert three.steps() == [1, 2] and three.latest_step() == 2


def test_damaged_chunk_is_skipped_while_loading_or_by_verify(three: CheckpointManager) -> None:
    path = three.path(3)
    data = bytearray(path.read_bytes())
    data[4096 + 10] ^= 0xFF  # inside the first chunk's payload: header, trailer and index still fine
    path.write_bytes(bytes(data))
    assert three.steps() == [1, 2, 3]  # the cheap check cannot see it
    with pytest.warns(SkippedCheckpointWarning, match=f"{_ckpt(3)}.*failed while loading"):
        _restore_and_check(three, 2)
    with pytest.warns(SkippedCheckpointWarning, match=f"{_ckpt(3)}.*Corrupt"):
        _restore_and_check(three, 2, verify=True)


def test_missing_or_bad_pointer_falls_back_to_the_newest_by_step(three: CheckpointManager) -> None:
    pointer = three.directory / "latest"
    pointer.unlink()
    _restore_and_check(three, 3)  # no pointer: scan, no warning
    pointer.write_text("../../etc/passwd\n")
    with pytest.warns(SkippedCheckpointWarning, match="ignoring pointer"):
        _restore_and_check(three, 3)
    pointer.write_text(_ckpt(2) + "\n")  # a readable file: followed, although 3 has a higher step
    _restore_and_check(three, 2)  # (3 was written before latest: an abandoned run's, say)
    # A crash between a save's rename and its pointer update: step 3 was written after latest.
    older = three.path(3).stat().st_mtime_ns - 10**9
    os.utime(pointer, ns=(older, older))
    _restore_and_check(three, 3)
    assert three.latest_step() == 3
    pointer.write_text(_ckpt(2) + "\n")
    three.path(2).unlink()
    # 3 was written before latest, so by an abandoned run (one manager never moves latest back):
    # the run latest names falls back to its own earlier step first
    with pytest.warns(SkippedCheckpointWarning, match=f"{_ckpt(2)}.*latest.*missing"):
        _restore_and_check(three, 1)


def test_every_checkpoint_damaged_returns_none(three: CheckpointManager) -> None:
    for step in (1, 2, 3):
        three.path(step).write_bytes(b"\0" * 100)
    with pytest.warns(SkippedCheckpointWarning) as record:
        assert three.restore_latest(state={"w": torch.zeros(2000)}) is None
    assert len(record) == 3


def test_no_checkpoint_restored_after_one_wrote_part_of_itself_raises_not_none(three: CheckpointManager) -> None:
    """A damaged chunk found while loading leaves the targets partly written: ``None`` (a fresh
    start, the caller's model untouched) would then be a lie. Where an older checkpoint loads,
    it overwrites everything, as before."""
    for step in (1, 2):
        three.path(step).write_bytes(b"\0" * 100)  # found by the checks: nothing written
    path = three.path(3)
    data = bytearray(path.read_bytes())
    data[4096 + 10] ^= 0xFF  # the first chunk: header, trailer and index still fine
    path.write_bytes(bytes(data))
    target = {"w": torch.zeros(2000), "b": torch.zeros(10)}
    with pytest.warns(SkippedCheckpointWarning), pytest.raises(gdsckpt.CorruptCheckpointError,
                                                               match="hold part of .*step 3.*not a fresh start"):
        three.restore_latest(state=target)
    # Without targets nothing is written: no checkpoint is still None.
    with pytest.warns(SkippedCheckpointWarning):
        assert three.restore_latest() is None


# ---------------------------------------------------------------------------------------------
# crash and resume: SIGKILL at random moments

STEPS = 60  # training steps of the whole run
CAP = 44  # killed workers are stopped before they get further than this
KILLS = 22
DURING_RESTORE = {7, 15}  # these kills may land before the restore finished; every other one after it
STANDBYS = 2  # workers importing torch while the current one trains
WORKER = Path(__file__).with_name("resume_worker.py")


class Worker:
    """A ``resume_worker.py`` process (spawned, not forked) and a thread reading its events."""

    def __init__(self, mode: str, directory: Path, log: Path, env: dict[str, str]):
        self.log = log
        with log.open("w") as stderr:
            self.proc = subprocess.Popen([sys.executable, str(WORKER), mode, str(directory), str(STEPS)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                         text=True, env=env, cwd=str(WORKER.parent.parent))
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put(None)

    def next(self, timeout: float) -> dict[str, Any] | None:
        """The next event; None at the end of output. Raises ``queue.Empty`` on timeout."""
        return self.events.get(timeout=max(timeout, 0.0))

    def expect(self, kind: str, timeout: float = 120) -> dict[str, Any]:
        event = self.next(timeout)
        assert event is not None and event["event"] == kind, (event, self.stderr())
        return event

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stderr(self) -> str:
        return self.log.read_text()[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # a standby that never got "go" exits
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()


def _expected_restore(directory: Path) -> tuple[int, bool]:
    """The step restore_latest must pick, worked out independently (every file under a final name
    is complete): the highest-numbered checkpoint written after ``latest`` was, else the one
    ``latest`` names, else the highest-numbered one. Also: whether the first case applied (the
    process died between a checkpoint's rename and the pointer update)."""
    steps = {int(p.name[5:15]): p for p in directory.glob("step-*.gdsckpt")}
    pointer = directory / "latest"
    if not pointer.exists():
        return max(steps, default=0), False
    named = int(pointer.read_text()[5:15])
    newer = [s for s, p in steps.items() if s > named and p.stat().st_mtime_ns > pointer.stat().st_mtime_ns]
    if newer:
        return max(newer), True
    assert named in steps
    return named, False


def test_sigkill_at_random_moments_resumes_bit_exact(tmp_path: Path, h: Any) -> None:
    seed = int(os.environ.get("RESUME_KILL_SEED", "20240604"))
    rng = random.Random(seed)
    env = h.subprocess_env()
    directory, ref_dir, logs = tmp_path / "ckpt", tmp_path / "reference", tmp_path / "logs"
    for d in (directory, ref_dir, logs):
        d.mkdir()
    started = time.monotonic()
    reference = Worker("reference", ref_dir, logs / "reference.err", env)
    spawned = 0

    def spawn() -> Worker:
        nonlocal spawned
        spawned += 1
        return Worker("train", directory, logs / f"worker-{spawned}.err", env)

    standbys = deque(spawn() for _ in range(STANDBYS))
    restores: list[dict[str, Any]] = []  # every "restored" event, with what we expected
    kills = torn = behind = window_restores = 0
    finished: dict[str, Any] | None = None
    try:
        while finished is None:
            worker = standbys.popleft()
            if spawned < KILLS + 1:
                standbys.append(spawn())
            worker.expect("ready")
            expected, window = _expected_restore(directory)
            newest = max((int(p.name[5:15]) for p in directory.glob("step-*.gdsckpt")), default=0)
            worker.go()
            if kills == KILLS:  # the last worker runs to the end
                event = worker.expect("restored")
                restores.append({**event, "expected": expected})
                while (event := worker.next(120)) is not None:
                    if event["event"] == "done":
                        finished = event
                assert worker.proc.wait(60) == 0, worker.stderr()
                worker.close()
                break
            # Kill at a random moment: a random delay after the start (often during the restore), or,
            # once restored, a random delay or a random number of training steps plus a little
            # jitter (often inside a background save).
            during_restore = kills in DURING_RESTORE
            by_time = during_restore or rng.random() < 0.3
            delay = rng.uniform(0.0, 0.05) if during_restore else rng.uniform(0.0, 0.2)
            deadline = time.monotonic() + (delay if during_restore else 60)
            steps_wanted = rng.randint(0, 8)
            steps_seen = 0
            restored_seen = False
            while True:
                try:
                    event = worker.next(deadline - time.monotonic())
                except queue.Empty:
                    break
                assert event is not None, f"worker exited on its own:\n{worker.stderr()}"
                if event["event"] == "restored":
                    restored_seen = True
                    restores.append({**event, "expected": expected})
                    if by_time and not during_restore:
                        deadline = time.monotonic() + delay
                elif event["event"] == "step":
                    steps_seen += 1
                    if event["step"] >= CAP:
                        break
                if not by_time and restored_seen and steps_seen >= steps_wanted:
                    time.sleep(rng.uniform(0.0, 0.06))
                    break
            os.kill(worker.proc.pid, signal.SIGKILL)
            assert worker.proc.wait(60) == -signal.SIGKILL
            kills += 1
            while (event := worker.next(10)) is not None:  # what it printed before dying
                if event["event"] == "restored":
                    restores.append({**event, "expected": expected})
            worker.close()
            torn += any(TEMP_MARKER in p.name for p in directory.iterdir())
            window_restores += window
            behind += expected < newest
        ref_states = {}
        while (event := reference.next(120)) is not None:
            if event["event"] == "state":
                ref_states[event["step"]] = event["digest"]
        assert reference.proc.wait(60) == 0, reference.stderr()
    finally:
        for worker in standbys:
            worker.close()
        for worker in [reference]:
            if worker.proc.poll() is None:
                worker.proc.kill()
            worker.close()

    # every restore picked the checkpoint the rule names and holds that step's state bit for bit
    assert kills == KILLS >= 20
    assert len(restores) >= KILLS - len(DURING_RESTORE) + 1  # each restart not killed early, and the last
    for restore in restores:
        assert restore["step"] == restore["expected"], restore
        assert restore["digest"] == ref_states[restore["step"]], f"restore of step {restore['step']} differs"
        assert restore["warnings"] == [], restore
    assert [r["step"] for r in restores] == sorted(r["step"] for r in restores), "progress went backwards"
    # the run that was killed 20+ times ends where the uninterrupted one does, bit for bit
    assert finished is not None and finished["step"] == STEPS and not finished["dynamo"]
    h.assert_same(gdsckpt.load(ref_dir / "final.gdsckpt"), gdsckpt.load(tmp_path / "final.gdsckpt"))
    assert finished["steps"] == [STEPS - 2, STEPS]
    assert _names(directory) == ["latest", _ckpt(STEPS - 2), _ckpt(STEPS)], "left-over files"
    print(f"\nkill test (seed {seed}): {kills} SIGKILLs, {len(restores)} restores all bit-exact, "
          f"{torn} kills left a partial temporary file, {window_restores} restarts found a checkpoint "
          f"completed after latest was written (killed between its rename and the pointer update), "
          f"{behind} restarts not from the highest-numbered file, "
          f"restored steps {[r['step'] for r in restores]}, {time.monotonic() - started:.1f} s")


def test_the_uploader_survives_a_failing_round_even_when_warnings_are_errors(caplog: pytest.LogCaptureFixture) -> None:
    """A round that raises is recorded and reported; with ``-W error`` the warning cannot be
    raised in the uploader's thread without ending it, so it is logged, and ``wait_idle`` still
    returns (it would wait forever for a thread that died)."""
    from gdsckpt.manager.remote import Uploader

    calls = []

    def failing_round() -> None:
        calls.append(1)
        raise ConnectionError("server gone")

    uploader = Uploader(failing_round, name="test-uploader")
    with warnings.catch_warnings(), caplog.at_level("ERROR", logger="gdsckpt"):
        warnings.simplefilter("error")
        uploader.request()
        assert uploader.wait_idle(timeout=30)
    assert isinstance(uploader.error, ConnectionError) and "server gone" in caplog.text
    uploader.request()  # a later round runs again
    assert uploader.wait_idle(timeout=30) and len(calls) == 2


def test_a_later_step_renamed_before_an_earlier_one_moved_latest_is_restored(tmp_path: Path) -> None:
    """Two saves in flight (``max_inflight=2``): step 2's file is in place first, then step 1's
    save ends and moved ``latest`` to step 1, written after step 2's rename. A process killed
    before step 2's own update restored step 1: step 2, intact, no longer counted as completed
    after ``latest``. Now step 1's update names step 2, whose file is already complete."""
    manager = CheckpointManager(tmp_path, keep_last=3, max_inflight=2)
    manager.save(0, {"w": torch.zeros(1000)})
    completed = manager._completed
    killed = threading.Event()  # step 2's update never runs while this is unset: the kill

    def steered(step: int, token: int) -> None:
        if step == 1:
            deadline = time.monotonic() + 30
            while not manager.path(2).exists():
                assert time.monotonic() < deadline
                time.sleep(0.001)
        if step == 2:
            assert killed.wait(60)
        completed(step, token)

    manager._completed = steered  # type: ignore[method-assign]
    first = manager.save_async(1, {"w": torch.full((1000,), 1.0)})
    second = manager.save_async(2, {"w": torch.full((1000,), 2.0)})
    first.wait(60)
    try:
        restored = CheckpointManager(tmp_path, keep_last=3).restore_latest()
        assert restored is not None and restored[0] == 2 and torch.equal(restored[1]["w"], torch.full((1000,), 2.0))
    finally:
        killed.set()
        second.wait(60)


def test_a_restore_while_another_process_prunes_every_listed_checkpoint_lists_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader whose every listed checkpoint was pruned by a trainer saving meanwhile
    (``keep_last=1``) returned None, a fresh start, while a newer checkpoint was on disk."""
    import gdsckpt.manager as manager_module

    trainer = CheckpointManager(tmp_path / "run", keep_last=1)
    trainer.save(1, {"w": torch.full((100,), 1.0)})
    problem = manager_module._problem
    saved_meanwhile: list[int] = []

    def pruned_meanwhile(path: Any, **kwargs: Any) -> Any:
        if not saved_meanwhile:
            saved_meanwhile.append(2)
            trainer.save(2, {"w": torch.full((100,), 2.0)})  # prunes step 1, the reader's one candidate
        return problem(path, **kwargs)

    monkeypatch.setattr(manager_module, "_problem", pruned_meanwhile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedCheckpointWarning)
        restored = CheckpointManager(tmp_path / "run", keep_last=1).restore_latest()
    assert saved_meanwhile and restored is not None and restored[0] == 2
    assert torch.equal(restored[1]["w"], torch.full((100,), 2.0))


def test_a_restarted_run_keeps_its_own_checkpoints_over_an_abandoned_runs_higher_steps(tmp_path: Path) -> None:
    """Run 2 restarted from step 0 beside run 1's steps 100-300: keep_last counted run 1's
    higher steps first, pruned all of run 2's but the one latest named, and when that one proved
    damaged the restore fell back to run 1's step 300."""
    def state(run: int, step: int) -> dict[str, Any]:
        return {"w": torch.full((1000,), float(run)), "step": step, "run": run}

    first = CheckpointManager(tmp_path, keep_last=3)
    for step in (100, 200, 300):
        first.save(step, state(1, step))
    second = CheckpointManager(tmp_path, keep_last=3)
    for step in (10, 20, 30):
        second.save(step, state(2, step))
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".gdsckpt") == [
        second.path(step).name for step in (10, 20, 30, 300)]  # keep_last of its own, and the newest by step
    damaged = second.path(30)
    chunk = gdsckpt.inspect(damaged).chunks[0]
    with open(damaged, "r+b") as handle:
        handle.seek(chunk.offset + 1)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 1]))
    with pytest.warns(SkippedCheckpointWarning, match="named by latest"):
        restored = CheckpointManager(tmp_path, keep_last=3).restore_latest()
    assert restored is not None and restored[0] == 20 and restored[1]["run"] == 2


def test_latest_wins_over_an_abandoned_runs_higher_step_after_a_chmod_or_a_copy(tmp_path: Path) -> None:
    """A run went back from step 5 to 3 (a fresh process saved 3 again: latest -> 3, 5 kept as the
    abandoned run's highest). Telling 5 (before latest) from a save that completed after latest
    by change times failed once anything moved its ctime: after a ``chmod`` of the files, or in a
    ``cp -a`` / ``rsync -a`` copy of the run, restore_latest took the abandoned run's step 5. The
    pointer records the checkpoints above it instead."""
    import shutil

    def state(run: str, step: int) -> dict[str, Any]:
        return {"w": torch.full((1000,), float(step)), "run": run}

    directory = tmp_path / "run"
    first = CheckpointManager(directory, keep_last=2)
    for step in range(1, 6):
        first.save(step, state("first", step))
    CheckpointManager(directory, keep_last=2).save(3, state("second", 3))
    assert "superseded" in (directory / "latest").read_text()
    for path in directory.iterdir():  # a chmod to the mode it has: the ctime moves
        os.chmod(path, path.stat().st_mode & 0o7777)
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)  # mtimes kept, ctimes now
    for where in (directory, copy):
        restored = CheckpointManager(where, keep_last=2).restore_latest()
        assert restored is not None and (restored[0], restored[1]["run"]) == (3, "second"), where

    # A save of the new run over the abandoned step's name that completed while latest was not
    # updated (killed between the rename and the pointer's write) is newer than latest, and tried first.
    second = CheckpointManager(copy, keep_last=2)
    second.save(4, state("second", 4))
    pointer = (copy / "latest").read_bytes()
    second.save(5, state("second", 5))
    (copy / "latest").write_bytes(pointer)  # as if killed before latest moved to 5
    restored = CheckpointManager(copy, keep_last=2).restore_latest()
    assert restored is not None and (restored[0], restored[1]["run"]) == (5, "second")


def test_latest_records_what_it_supersedes_for_a_prefix_with_spaces_and_a_replayed_save(tmp_path: Path) -> None:
    """Two cases of the records in ``latest``: a prefix with spaces ("my run") made every record
    line unreadable, so the whole pointer was ignored and a restore took the abandoned run's
    step; a rollback's re-save of a step with the same bytes (saves are deterministic) looked
    like the abandoned file it replaced, and a save killed before its pointer update was tried
    last."""
    def state(step: int) -> dict[str, Any]:
        return {"w": torch.full((1000,), float(step))}

    first = CheckpointManager(tmp_path, prefix="my run", keep_last=2)
    for step in range(1, 6):
        first.save(step, state(step))
    second = CheckpointManager(tmp_path, prefix="my run", keep_last=2)
    second.save(3, state(3))
    assert second.latest_step() == 3
    second.save(4, state(4))
    pointer = (tmp_path / "latest").read_bytes()
    second.save(5, state(5))  # the same bytes as the abandoned run's step 5
    (tmp_path / "latest").write_bytes(pointer)  # as if killed before latest moved to 5
    fresh = CheckpointManager(tmp_path, prefix="my run", keep_last=2)
    assert fresh.latest_step() == 5
    restored = fresh.restore_latest()
    assert restored is not None and restored[0] == 5
    with pytest.raises(ValueError, match="line break"):
        CheckpointManager(tmp_path, prefix="two\nlines")


def test_a_save_begun_before_a_rollback_and_completed_after_it_is_superseded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``save_async(30)`` in flight, then ``save(20)`` (a rollback: latest -> 20): 30 completed
    after latest was written, recorded by nothing, and a restart took it, the step the run had
    gone back from."""
    gate = threading.Event()
    publish = posix.publish

    def held_publish(temp: Path, target: Path, **kwargs: Any) -> None:
        if Path(target).name == _ckpt(30):
            assert gate.wait(60)
        publish(temp, target, **kwargs)

    monkeypatch.setattr(posix, "publish", held_publish)
    manager = CheckpointManager(tmp_path, keep_last=None, max_inflight=2)
    manager.save(10, _state(10))
    manager.save(25, _state(25))
    handle = manager.save_async(30, _state(30))
    manager.save(20, _state(20))  # the rollback
    gate.set()
    handle.wait(timeout=60)
    manager.wait(60)
    assert manager.path(30).exists()
    fresh = CheckpointManager(tmp_path, keep_last=None)
    assert fresh.latest_step() == 20
    restored = fresh.restore_latest()
    assert restored is not None and restored[0] == 20


def test_pruning_removes_deltas_before_their_bases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pruning removed files in directory order: a process killed after removing a base left a
    delta under a checkpoint name whose base was gone (``verify --chain`` failed on it)."""
    import gdsckpt.manager as manager_module

    real_remove = manager_module.remove_releasing
    removed: list[str] = []

    def remove_then_die(path: Any, *args: Any) -> None:
        real_remove(path, *args)
        removed.append(Path(path).name)
        raise KeyboardInterrupt  # the process killed right after its first removal

    manager = CheckpointManager(tmp_path, keep_last=1, delta_every=1, max_chain=2)
    for step in range(1, 5):
        manager.save(step, {"w": torch.full((1000,), float(step))})
    # 3 a delta on 2 on 1; 4 starts a new chain, and the save after it prunes the old one
    assert gdsckpt.inspect(manager.path(3)).base is not None and gdsckpt.inspect(manager.path(4)).base is None
    monkeypatch.setattr(manager_module, "remove_releasing", remove_then_die)
    with pytest.raises(KeyboardInterrupt):
        manager.save(5, {"w": torch.full((1000,), 5.0)})
    assert removed == [_ckpt(3)]  # the highest unkept first (a delta on 2), not its base
    for path in tmp_path.glob("*.gdsckpt"):
        gdsckpt.verify(path, chain=True)  # every file left under a checkpoint name loads


def test_a_rollback_to_a_lower_step_moves_latest_to_it(tmp_path: Path) -> None:
    """One manager saved 10, 20, 30 (30 a delta on 20), then, gone back to step 20, saved it
    again: step 20 was replaced (by design), but latest still named 30, whose base had changed,
    and every restore warned and fell back. A save begun below a step the manager completed is a
    rollback: latest names it."""
    def state(value: float) -> dict[str, Any]:
        return {"w": torch.full((1000,), value)}

    manager = CheckpointManager(tmp_path, keep_last=3, delta_every=10)
    for step in (10, 20, 30):
        manager.save(step, state(step))
    assert gdsckpt.inspect(manager.path(30)).base is not None  # a delta, on 20
    manager.save(20, state(21.0))
    assert manager.latest_step() == 20
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkippedCheckpointWarning)
        restored = CheckpointManager(tmp_path, keep_last=3).restore_latest()
    assert restored is not None and restored[0] == 20 and torch.equal(restored[1]["w"], torch.full((1000,), 21.0))
    manager.save_async(20, state(22.0)).wait(60)  # again, in the background
    manager.save(25, state(25.0))
    assert manager.latest_step() == 25


def test_a_newer_gdsckpts_checkpoint_is_raised_never_passed_over_or_pruned(tmp_path: Path, config: gdsckpt.Config,
                                                                            h: Any) -> None:
    """A checkpoint naming a codec this version does not know (``zstd/2``: a newer writer's, read
    after gdsckpt was rolled back) was taken for damage: ``restore_latest`` restored the older
    step with a warning, throwing the newer one's progress away, and pruning would remove it."""
    manager = CheckpointManager(tmp_path, keep_last=1, config=config.replace(codec="zstd"))
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    manager.save(3, _state(3))
    assert [p.name for p in sorted(tmp_path.glob("*.gdsckpt"))] == [_ckpt(3)]

    def newer_codec(doc: dict[str, Any]) -> None:
        for chain in doc["chains"]:
            for stage in chain:
                if stage["name"] == "zstd/1":
                    stage["name"] = "zstd/2"

    h.rewrite_index(manager.path(3), newer_codec)
    with pytest.raises(gdsckpt.NewerFormatError, match="zstd/2.*upgrade gdsckpt"):
        manager.restore_latest(state={"w": torch.zeros(2000), "b": torch.zeros(10)})
    with pytest.warns(RuntimeWarning, match="pruning .* was skipped: NewerFormatError"):
        manager.save(4, _state(4))
    with pytest.warns(RuntimeWarning, match="pruning .* was skipped"):
        manager.save(5, _state(5))
    assert manager.path(3).exists(), "a newer gdsckpt's file is never pruned"
    _restore_and_check(manager, 5)


def test_a_delta_whose_base_is_missing_is_passed_over_before_anything_is_written(tmp_path: Path,
                                                                               config: gdsckpt.Config) -> None:
    """Its base is checked with the candidate's other checks: a missing base is not a load that
    failed after writing part of itself (``None`` stays a fresh start, the targets untouched)."""
    manager = CheckpointManager(tmp_path, config=config, delta_every=1, full_every=100)
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    assert gdsckpt.inspect(manager.path(2)).base is not None, "step 2 is a delta on step 1"
    manager.path(1).unlink()
    target = {"w": torch.zeros(2000), "b": torch.zeros(10)}
    with pytest.warns(SkippedCheckpointWarning, match="missing"):
        assert manager.restore_latest(state=target) is None
    assert torch.equal(target["w"], torch.zeros(2000))


def test_latest_step_passes_over_a_delta_whose_base_is_missing_as_restore_does(tmp_path: Path,
                                                                              config: gdsckpt.Config) -> None:
    manager = CheckpointManager(tmp_path, config=config, delta_every=1, full_every=3)
    for step in (1, 2, 3, 4):
        manager.save(step, _state(step))
    assert gdsckpt.inspect(manager.path(4)).base is not None and gdsckpt.inspect(manager.path(3)).base is None
    manager.path(3).unlink()
    with pytest.warns(SkippedCheckpointWarning):
        restored = manager.restore_latest(state={"w": torch.zeros(2000), "b": torch.zeros(10)})
    assert restored is not None and restored[0] == manager.latest_step() == 2


def test_saves_in_flight_after_a_rollback_leave_latest_on_the_later_begun(tmp_path: Path,
                                                                           config: gdsckpt.Config) -> None:
    """Steps 10, 20, 30, then the run goes back and saves 15 and 16 together (``max_inflight=2``),
    16 finishing first: 15's completion moved ``latest`` back from 16 (each counted as a rollback
    on its own), and a restart restored 15, throwing 16 away. Driven through the manager's own
    begin / complete / end in that order, with real files."""
    manager = CheckpointManager(tmp_path, keep_last=None, config=config)
    for step in (10, 20, 30):
        manager.save(step, _state(step))
    begun = {step: manager._begin(step, _state(step)) for step in (15, 16)}
    for step in (16, 15):
        path, token = begun[step]
        gdsckpt.save(_state(step), path, config=config)
        manager._completed(step, token)
        manager._end(step, token)
    _restore_and_check(CheckpointManager(tmp_path, config=config), 16)
    manager.save(17, _state(17))  # the run goes on from 16
    _restore_and_check(CheckpointManager(tmp_path, config=config), 17)


def test_a_save_begun_before_a_rollback_keeps_its_epoch_beside_the_rollbacks_save_of_its_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``save_async(6)`` held before its rename, then 10, then 3 (a rollback), then the rollback's
    own ``save_async(6)``: the epoch was kept per step, so the second save's begin gave the first
    (of the run gone back from) the rollback's epoch, its completion moved ``latest`` to the
    abandoned run's 6, and with the rollback's save of 6 failed, restores took it."""
    gate = threading.Event()
    publishes: list[str] = []
    publish = posix.publish

    def held_publish(temp: Path, target: Path, **kwargs: Any) -> None:
        if Path(target).name == _ckpt(6):
            publishes.append(Path(target).name)
            if len(publishes) == 1:
                assert gate.wait(60)  # the first save of 6: held before its rename
            else:
                Path(temp).unlink()  # the rollback's save of 6 fails at its rename
                raise OSError(28, "No space left on device (injected)")
        publish(temp, target, **kwargs)

    def state(step: int, run: str) -> dict[str, Any]:
        return {"w": torch.full((16,), float(step)), "run": run}

    monkeypatch.setattr(posix, "publish", held_publish)
    manager = CheckpointManager(tmp_path, keep_last=None, max_inflight=2)
    first = manager.save_async(6, state(6, "first"))
    manager.save(10, state(10, "first"))
    manager.save(3, state(3, "second"))  # the rollback
    threading.Timer(0.5, gate.set).start()  # the first save of 6 completes while the second waits for it
    second = manager.save_async(6, state(6, "second"))
    first.wait(60)
    with pytest.raises(OSError, match="injected"):
        second.wait(60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedCheckpointWarning)
        restored = CheckpointManager(tmp_path, keep_last=None).restore_latest()
    assert restored is not None and (restored[0], restored[1]["run"]) == (3, "second")
