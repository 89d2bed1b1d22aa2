"""Crash consistency: processes saving checkpoints are killed with SIGKILL at random moments.

``gdsckpt.save`` to one path: after every kill the path holds the previous complete checkpoint or
the new complete one (``verify`` passes, content bit-exact equal to one of the two), never a
partial one, and the temporary file a kill leaves is removed by the next save.

``CheckpointManager``: after every kill during ``save`` / ``save_async`` loops, ``restore_latest``
succeeds (no checkpoint skipped) and returns the newest complete step, bit-exact.

Kills are timed from the moment the child reports that its first save begins, with a random delay
spanning a save, the "training" between two saves and part of the next save; the tests count where
the kills landed, to show that they exercised the write window. ``tests/test_manager.py`` kills a
torch training loop (restore and resume); these kill numpy-only children, cheaper to start, many
more times, and check the file level.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gdsckpt
from gdsckpt.io.posix import TEMP_MARKER

from .harness import Child, record_figure
from .worker import CRASH_ELEMENTS, MANAGER_ELEMENTS, config, state_for

KILLS = 50
MANAGER_KILLS = 30
STANDBYS = 2  # children importing gdsckpt while the current one saves


def _seed() -> int:
    return int(os.environ.get("RELIABILITY_SEED", "20250806"))


def _temporaries(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if TEMP_MARKER in p.name}


def _save_and_generate_seconds(path: Path, elements: int) -> float:
    """How long one save plus the next state's generation take here (the window kills must span)."""
    started = time.perf_counter()
    gdsckpt.save(state_for(0, elements), path, config=config())
    state_for(1, elements)
    return time.perf_counter() - started


def _kill_rounds(h: Any, logs: Path, mode: str, path: Path, kills: int, estimate: float, first: int,
                 after_kill: Callable[[int, list[dict[str, Any]]], int]) -> float:
    """Run ``kills`` children of ``mode`` one after another. Each gets ``go FIRST`` and is killed
    a random delay after its first ``begin`` event, uniform in [0, 2.2 x a save's duration): the
    save, the "training" before the next one and part of that. The duration is the median the
    children reported so far (``saved`` events); until there are three, ``estimate``, raised after
    each child killed before it finished a save.
    ``after_kill(first, events)`` checks what the child left and returns FIRST for the next one.
    Returns the last span."""
    rng = random.Random(_seed())
    env = h.subprocess_env()
    logs.mkdir(exist_ok=True)
    spawned = 0
    durations: list[float] = []

    def spawn() -> Child:
        nonlocal spawned
        spawned += 1
        return Child(env, logs / f"{mode}-{spawned}.err", mode, str(path))

    standbys = deque(spawn() for _ in range(STANDBYS))
    span = 2.2 * estimate
    child = None
    try:
        for _ in range(kills):
            child = standbys.popleft()
            if spawned < kills:
                standbys.append(spawn())
            child.expect("ready")
            child.send(f"go {first}")
            child.expect("begin")
            if len(durations) >= 3:
                span = 2.2 * sorted(durations)[len(durations) // 2]
            time.sleep(rng.uniform(0.0, span))
            events = child.kill()
            finished = [e["seconds"] for e in events if e["event"] == "saved"]
            if not finished and len(durations) < 3:
                span *= 1.3  # the estimate is short of what a save takes in a child here
            durations += finished
            first = after_kill(first, events)
    finally:
        if child is not None and child.proc.poll() is None:  # a check failed while it saved
            child.proc.kill()
            child.close()
        for standby in standbys:
            standby.close()
    return span


class Tally:
    """Where the kills landed, the children's save times, and the temporary files kills left."""

    def __init__(self) -> None:
        self.landed: Counter[str] = Counter()
        self.save_seconds: list[float] = []
        self.temporaries: set[str] = set()

    def outcome(self, first: int, previous: int, events: list[dict[str, Any]]) -> tuple[int, int | None]:
        """(last acknowledged version, version in flight or None) of a killed child."""
        saved = [e["version"] for e in events if e["event"] == "saved"]
        self.save_seconds += [e["seconds"] for e in events if e["event"] == "saved"]
        begun = [first] + [e["version"] for e in events if e["event"] == "begin"]  # the first was taken
        in_flight = begun[-1] if begun[-1] not in saved else None
        return max(saved, default=previous), in_flight

    def mid_save(self) -> int:
        return sum(n for where, n in self.landed.items() if where.startswith("mid-save"))

    def summary(self) -> str:
        self.save_seconds.sort()
        median = self.save_seconds[len(self.save_seconds) // 2] if self.save_seconds else float("nan")
        return (f"{self.mid_save()} landed mid-save ("
                + ", ".join(f"{n} {where}" for where, n in sorted(self.landed.items()))
                + f"); {len(self.temporaries)} half-written temporary files left by kills, all removed by "
                f"the next save or restart; median save in the children {median * 1000:.0f} ms")


def test_sigkill_during_save_leaves_the_previous_or_the_new_checkpoint(tmp_path: Path, h: Any) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    target = directory / "state.gdsckpt"
    estimate = _save_and_generate_seconds(target, CRASH_ELEMENTS)  # the target holds version 0
    tally = Tally()
    held = [0]  # the version the target holds
    left_before: list[set[str]] = [set()]

    def after_kill(first: int, events: list[dict[str, Any]]) -> int:
        acknowledged, in_flight = tally.outcome(first, held[0], events)
        temporaries = _temporaries(directory)
        # The target: verify passes and the content is one of the two candidates, bit for bit.
        gdsckpt.verify(target, config=config())
        loaded = gdsckpt.load(target, config=config())
        version = loaded["meta"]["version"]
        assert version in {acknowledged, in_flight}, (version, acknowledged, in_flight, events)
        h.assert_same(state_for(version, CRASH_ELEMENTS), loaded)
        assert len(temporaries) <= 1, temporaries
        if in_flight is None:
            tally.landed["between saves"] += 1
        elif version == in_flight:
            tally.landed["mid-save after the rename: new checkpoint"] += 1
        elif temporaries - left_before[0]:
            tally.landed["mid-save with a half-written temporary file: previous checkpoint"] += 1
        else:
            tally.landed["mid-save before the temporary file existed: previous checkpoint"] += 1
        if any(e["event"] == "saved" for e in events):  # this child's writer removed the last one's
            assert not left_before[0] & temporaries, "a dead writer's temporary file survived a save"
        tally.temporaries |= temporaries
        left_before[0] = temporaries
        held[0] = version
        return max([first] + [e["version"] for e in events if e["event"] == "begin"]) + 1

    span = _kill_rounds(h, tmp_path / "logs", "save-loop", target, KILLS, estimate, 1, after_kill)
    gdsckpt.save(state_for(10**6, 1000), target, config=config())  # the next save removes what is left
    assert sorted(p.name for p in directory.iterdir()) == [target.name]
    assert sum(tally.landed.values()) == KILLS
    # The kills exercised the window: most landed inside a save, several half-way through a
    # temporary file.
    assert tally.mid_save() >= KILLS // 2, tally.landed
    assert tally.landed["mid-save with a half-written temporary file: previous checkpoint"] >= 5, tally.landed
    record_figure("sigkill during gdsckpt.save", (
        f"{KILLS} kills: {KILLS} previous-or-new complete checkpoints, 0 partial (seed {_seed()}, kills "
        f"0-{span * 1000:.0f} ms after a save began); " + tally.summary()))


def _steps(directory: Path) -> list[int]:
    return sorted(int(p.name[5:15]) for p in directory.glob("step-*.gdsckpt"))


def test_sigkill_during_manager_saves_restores_the_newest_complete_step(tmp_path: Path, h: Any) -> None:
    directory = tmp_path / "run"
    manager = gdsckpt.CheckpointManager(directory, keep_last=2, config=config())
    started = time.perf_counter()
    manager.save(0, state_for(0, MANAGER_ELEMENTS))
    state_for(1, MANAGER_ELEMENTS)
    estimate = time.perf_counter() - started
    tally = Tally()
    restored_step = [0]

    def after_kill(first: int, events: list[dict[str, Any]]) -> int:
        acknowledged, in_flight = tally.outcome(first, restored_step[0], events)
        temporaries = _temporaries(directory)
        on_disk = _steps(directory)
        pointer = int((directory / "latest").read_text()[5:15])
        # A restart: the manager removes the dead process's temporaries; restore_latest must not
        # skip anything (a SkippedCheckpointWarning is an error here) and returns the newest step.
        restarted = gdsckpt.CheckpointManager(directory, keep_last=2, config=config())
        assert not _temporaries(directory), "temporaries of the dead process survived the restart"
        restored = restarted.restore_latest()
        assert restored is not None
        step, everything = restored
        assert step == max(on_disk), (step, on_disk, events)
        assert step in {acknowledged, in_flight}, (step, acknowledged, events)
        h.assert_same(state_for(step, MANAGER_ELEMENTS), everything)
        for other in on_disk:  # every file under a checkpoint name is complete
            gdsckpt.verify(restarted.path(other), config=config())
        if in_flight is None:
            tally.landed["between saves"] += 1
        elif step == in_flight and pointer < step:
            tally.landed["mid-save between the rename and the update of latest"] += 1
        elif step == in_flight:
            tally.landed["mid-save after latest moved"] += 1
        elif temporaries:
            tally.landed["mid-save with a half-written temporary file"] += 1
        else:
            tally.landed["mid-save before the temporary file existed"] += 1
        tally.temporaries |= temporaries
        restored_step[0] = step
        return step + 1

    span = _kill_rounds(h, tmp_path / "logs", "manager-loop", directory, MANAGER_KILLS, estimate, 1,
                        after_kill)
    assert sum(tally.landed.values()) == MANAGER_KILLS
    assert tally.mid_save() >= MANAGER_KILLS // 3, tally.landed
    assert tally.landed["mid-save with a half-written temporary file"] >= 3, tally.landed
    record_figure("sigkill during CheckpointManager.save/save_async", (
        f"{MANAGER_KILLS} kills: restore_latest returned the newest complete step, bit-exact, "
        f"{MANAGER_KILLS} of {MANAGER_KILLS} times, 0 checkpoints skipped (seed {_seed()}, kills "
        f"0-{span * 1000:.0f} ms after a save began); " + tally.summary()))
