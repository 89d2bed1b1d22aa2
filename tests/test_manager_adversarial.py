"""Adversarial tests of ``CheckpointManager`` (local tier, remote tier on a real SeaweedFS server
from ``tests/seaweed.py``). Each test but the last found a bug (its docstring says what happened
before the fix); faults are injected (an exception at a chosen step, a frozen server process),
the S3 service itself is never mocked.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from seaweed import SeaweedServer, serving_bucket

import gdsckpt
from gdsckpt import CheckpointManager
from gdsckpt.errors import RemoteUploadError
from gdsckpt.io import posix
from gdsckpt.io.s3 import ObjectDirectory

BUCKET = "ckpt"


class Killed(BaseException):
    """Stands for the process being killed at the point where it is raised."""


def _ckpt(step: int) -> str:
    return f"step-{step:010d}.gdsckpt"


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(2000, generator=g), "b": torch.randn(10, generator=g), "step": step}


@pytest.fixture
def config(h: Any) -> gdsckpt.Config:
    return h.small_config()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    with serving_bucket(tmp_path_factory.mktemp("seaweedfs"), BUCKET) as weed:
        yield weed


@pytest.fixture
def remote(server: SeaweedServer, request: pytest.FixtureRequest) -> str:
    return f"s3://{BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}"


@pytest.fixture
def quiet() -> Iterator[None]:
    """Upload and skip warnings are expected in these scenarios (pytest turns warnings into errors)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ---------------------------------------------------------------------------------------------
# local tier


def test_a_kill_after_the_rename_of_a_concurrent_save_restores_that_newer_step(tmp_path: Path, config: gdsckpt.Config,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """max_inflight=2: step 20's file is fully written, then step 10 completes and moves ``latest``;
    step 20 is renamed into place and the process dies before its pointer update. Step 20 is
    complete, the highest, of this run: restore must pick it (the docstring's refinement for a death
    between rename and pointer update). It picked 10 when the refinement compared the file's
    mtime (its last write, before fsync and rename) with the pointer's."""
    manager = CheckpointManager(tmp_path, keep_last=None, config=config, max_inflight=2)
    manager.save(5, _state(5))
    entered, release = threading.Event(), threading.Event()
    publish = posix.publish

    def held_publish(temp: Path, target: Path, **kwargs: Any) -> None:
        if Path(target).name == _ckpt(20):
            entered.set()
            assert release.wait(30)
        publish(temp, target, **kwargs)

    monkeypatch.setattr(posix, "publish", held_publish)
    handle = manager.save_async(20, _state(20))
    assert entered.wait(30)  # 20 is written and fsynced, waiting for its rename
    time.sleep(0.05)  # beyond the coarse timestamp granularity
    manager.save(10, _state(10))  # completes first: latest -> 10
    assert (tmp_path / "latest").read_text() == _ckpt(10) + "\n"

    write_pointer = manager._write_pointer

    def dies_before_pointer(step: int, epoch: int) -> None:
        if step == 20:
            raise Killed
        write_pointer(step, epoch)

    monkeypatch.setattr(manager, "_write_pointer", dies_before_pointer)
    release.set()
    with pytest.raises(Killed):
        handle.wait(timeout=30)
    assert (tmp_path / _ckpt(20)).exists() and gdsckpt.verify(tmp_path / _ckpt(20))
    monkeypatch.undo()

    restored = CheckpointManager(tmp_path, keep_last=None, config=config).restore_latest()
    assert restored is not None
    assert restored[0] == 20, f"restored step {restored[0]}: the complete step 20 (renamed after latest) is lost"


# ---------------------------------------------------------------------------------------------
# remote tier (real SeaweedFS server)


def _fail_uploads_of(manager: CheckpointManager, steps: set[int] | None) -> None:
    """Injected fault: this manager's uploads of ``steps`` (None: all) fail as a network error would."""
    upload = ObjectDirectory.upload.__get__(manager.remote)

    def failing(path: Any, name: str) -> None:
        if steps is None or name in {_ckpt(s) for s in steps}:
            raise gdsckpt.CheckpointError(f"upload of {name}: injected connection reset")
        upload(path, name)

    manager.remote.upload = failing  # type: ignore[method-assign]


def test_wait_of_a_fresh_manager_keeps_the_checkpoint_latest_names(tmp_path: Path, config: gdsckpt.Config,
                                                                     remote: str, quiet: None) -> None:
    """A run restarted from step 2 left ``latest`` -> 2 beside the abandoned run's step 5. A new
    process (remote tier on) restores step 2 and calls ``wait()`` before its first save (e.g. a
    ``finally`` after training failed early). The docstring: pruning runs only after a save
    completed, and keeps the step ``latest`` names. ``wait()`` ran an upload round whose
    ``_prune(completed=-1)`` saw ``_pointer_step is None`` and deleted step 2: ``latest`` named a
    missing file and the next restore resumed the abandoned run's step 5."""
    abandoned = CheckpointManager(tmp_path, keep_last=3, config=config)
    for step in (3, 4, 5):
        abandoned.save(step, _state(step))
    restarted = CheckpointManager(tmp_path, keep_last=1, config=config)
    restarted.save(2, _state(2))
    assert (tmp_path / "latest").read_text().splitlines()[0] == _ckpt(2) and restarted.steps() == [2, 5]

    fresh = CheckpointManager(tmp_path, keep_last=1, config=config, remote=remote)
    restored = fresh.restore_latest()
    assert restored is not None and restored[0] == 2
    fresh.wait()
    assert (tmp_path / _ckpt(2)).exists(), "wait() pruned the checkpoint latest names (no save completed)"
    again = CheckpointManager(tmp_path, keep_last=1, config=config).restore_latest()
    assert again is not None and again[0] == 2


def test_a_fresh_manager_moves_the_remote_latest_a_dead_process_left_behind(tmp_path: Path, config: gdsckpt.Config,
                                                                           remote: str, quiet: None) -> None:
    """Step 5's object went up, but the remote ``latest`` PUT failed and the process died. A new
    manager on the same directory restored 5 and its ``wait()`` returned without an error, the
    remote ``latest`` still on 4: a replacement node then restored step 4 though 5 was complete on
    the remote. The new manager's first upload round now moves the remote ``latest`` up to the step
    the local one names (never down: another node may have moved it further)."""
    node = CheckpointManager(tmp_path / "node", keep_last=3, config=config, remote=remote)
    for step in (1, 2, 3, 4):
        node.save(step, _state(step))
    node.wait()
    real = node._write_remote_pointer

    def fails_at_five(step: int) -> None:
        if step == 5:
            raise gdsckpt.CheckpointError("the PUT of latest failed, and the process died right after")
        real(step)

    node._write_remote_pointer = fails_at_five  # type: ignore[method-assign]
    node.save(5, _state(5))
    assert node._uploader.wait_idle(30) and 5 in node.remote_steps()
    del node

    restarted = CheckpointManager(tmp_path / "node", keep_last=3, config=config, remote=remote)
    assert restarted.restore_latest()[0] == 5  # type: ignore[index]
    restarted.wait()
    replacement = CheckpointManager(tmp_path / "replacement", keep_last=3, config=config, remote=remote)
    restored = replacement.restore_latest()
    assert restored is not None and restored[0] == 5 and restored[1]["step"] == 5

    behind = CheckpointManager(tmp_path / "node", keep_last=3, config=config, remote=remote)
    replacement.save(6, _state(6))
    replacement.wait()
    behind.wait()  # its local latest names 5: the remote latest stays on the newer 6
    assert CheckpointManager(tmp_path / "third", keep_last=3, config=config, remote=remote).restore_latest()[0] == 6  # type: ignore[index]


def test_a_fresh_manager_sends_the_upload_a_dead_process_left_pending(tmp_path: Path, config: gdsckpt.Config,
                                                                      remote: str, quiet: None) -> None:
    """Process A saves step 2 but its upload fails, then A dies (no ``wait``). Process B opens the
    same directory and calls ``wait()``: the remote tier lacks step 2, the newest checkpoint, and
    ``wait()`` must upload it (or raise ``RemoteUploadError``). It did neither (``_unsent`` started
    empty), and a replacement node would have restored step 1."""
    first = CheckpointManager(tmp_path, config=config, remote=remote)
    first.save(1, _state(1))
    first.wait()
    _fail_uploads_of(first, {2})
    first.save(2, _state(2))
    assert first._uploader.wait_idle(30) and first.pending_uploads() == [2]
    del first  # killed: no wait(), no further save

    second = CheckpointManager(tmp_path, config=config, remote=remote)
    restored = second.restore_latest()
    assert restored is not None and restored[0] == 2
    try:
        second.wait()
    except RemoteUploadError:
        return  # told: acceptable
    assert 2 in second.remote_steps(), \
        f"wait() returned, but the remote tier has only {second.remote_steps()} (step 2 silently never uploaded)"


def test_a_round_that_fails_midway_still_moves_the_remote_latest_to_what_it_uploaded(
        tmp_path: Path, config: gdsckpt.Config, remote: str, quiet: None) -> None:
    """Steps 6 and 7 are pending; a round uploads 6, then 7's upload fails. The remote ``latest``
    must name 6: the node may die before a later round, and a replacement node restored step 5
    when ``_upload_round`` raised out of its loop before moving the pointer."""
    manager = CheckpointManager(tmp_path / "node-a", config=config, remote=remote, keep_last_remote=None)
    manager.save(5, _state(5))
    manager.wait()
    _fail_uploads_of(manager, None)  # the server is unreachable for a while
    manager.save(6, _state(6))
    manager.save(7, _state(7))
    assert manager._uploader.wait_idle(30) and manager.pending_uploads() == [6, 7]
    _fail_uploads_of(manager, {7})  # it is back, but step 7's upload fails once more
    with pytest.raises(RemoteUploadError):
        manager.wait()
    assert manager.remote_steps() == [5, 6]
    # the node is lost now
    restored = CheckpointManager(tmp_path / "node-b", config=config, remote=remote).restore_latest()
    assert restored is not None
    assert restored[0] == 6, f"restored step {restored[0]} from the remote tier; step 6 there is intact and newer"


def _remote_value(remote: str, config: gdsckpt.Config, tmp_path: Path) -> tuple[int, float]:
    """(step, ``w[0]``) a replacement node (an empty local tier) restores from ``remote``."""
    restored = CheckpointManager(tmp_path / "replacement", config=config, remote=remote).restore_latest()
    assert restored is not None
    return restored[0], float(restored[1]["w"][0])


def _valued(step: int, value: float) -> dict[str, Any]:
    state = _state(step)
    state["w"][0] = value
    return state


def test_a_step_saved_again_during_its_upload_goes_up_again(tmp_path: Path, config: gdsckpt.Config,
                                                             remote: str, quiet: None) -> None:
    """Step 2 is saved again while its first file is going up (a slow link). ``wait()`` returned,
    ``pending_uploads()`` was empty and the remote step 2 held the first file: the upload's end
    dropped the second save's pending entry with its own."""
    manager = CheckpointManager(tmp_path / "node", config=config, remote=remote)
    manager.save(1, _valued(1, 1.0))
    manager.wait()
    upload = manager.remote.upload
    uploading, saved_again = threading.Event(), threading.Event()

    def slow(path: Any, name: str) -> None:
        upload(path, name)  # the first file's bytes are up; the answer comes late
        if name == _ckpt(2) and not uploading.is_set():
            uploading.set()
            saved_again.wait(30)

    manager.remote.upload = slow  # type: ignore[method-assign]
    manager.save(2, _valued(2, 2.0))
    assert uploading.wait(30)
    manager.save(2, _valued(2, 22.0))
    saved_again.set()
    manager.wait()
    assert manager.pending_uploads() == []
    assert _remote_value(remote, config, tmp_path) == (2, 22.0)


def test_a_delta_on_a_step_saved_again_while_the_remote_was_down_uploads_that_base(
        tmp_path: Path, config: gdsckpt.Config, remote: str, quiet: None) -> None:
    """Steps 10 and 20 are up; during an outage the run goes back to 10 (saved again, full) and
    saves 15, a delta on the new 10. Once the remote was back, ``wait()`` succeeded with the old
    step-10 object still there: 15's base had "changed", and a replacement node restored the
    abandoned step 20."""
    manager = CheckpointManager(tmp_path / "node", config=config, remote=remote, keep_last_remote=1,
                                delta_every=5)
    manager.save(10, _valued(10, 10.0))
    manager.save(20, _valued(20, 20.0))
    manager.wait()
    _fail_uploads_of(manager, None)
    manager.save(10, _valued(10, 110.0))
    manager.save(15, _valued(15, 15.0))
    assert gdsckpt.inspect(tmp_path / "node" / _ckpt(15)).base is not None  # a delta on the new 10
    assert manager._uploader.wait_idle(30) and manager.pending_uploads() == [15]
    manager.remote.upload = ObjectDirectory.upload.__get__(manager.remote)  # type: ignore[method-assign]
    manager.wait()
    assert _remote_value(remote, config, tmp_path) == (15, 15.0)


def test_the_remote_tier_keeps_and_uploads_a_rolled_back_runs_own_checkpoints(
        tmp_path: Path, config: gdsckpt.Config, remote: str, quiet: None) -> None:
    """keep_last_remote=1: step 10 is up, the remote goes down, steps 20 and 30 are saved, then the
    run goes back to 15. What was pending was [30] (the highest step), so ``wait()`` uploaded the
    abandoned 30, and a replacement node restored 10 instead of 15."""
    manager = CheckpointManager(tmp_path / "node", config=config, remote=remote, keep_last_remote=1)
    manager.save(10, _valued(10, 10.0))
    manager.wait()
    _fail_uploads_of(manager, None)
    for step in (20, 30, 15):
        manager.save(step, _valued(step, float(step)))
    assert manager._uploader.wait_idle(30) and manager.pending_uploads() == [15]
    manager.remote.upload = ObjectDirectory.upload.__get__(manager.remote)  # type: ignore[method-assign]
    manager.wait()
    assert _remote_value(remote, config, tmp_path) == (15, 15.0)


def test_objects_only_pruning_after_a_rollback_keeps_the_runs_own_checkpoints(
        config: gdsckpt.Config, remote: str, quiet: None) -> None:
    """keep_last=2 on objects only: steps 10, 20, 30, then back to 15 and 16. Pruning kept the
    highest steps [16, 20, 30] and removed 15, so with 16 damaged ``restore_latest`` returned the
    abandoned 30 (the local tier keeps in restore order already)."""
    manager = CheckpointManager(remote, keep_last=2, config=config)
    for step in (10, 20, 30, 15, 16):
        manager.save(step, _valued(step, float(step)))
    assert manager.remote_steps() == [15, 16, 30]
    directory = ObjectDirectory(remote, endpoint=config.s3_endpoint)
    directory.write_small(_ckpt(16), b"damaged")
    restored = manager.restore_latest()
    assert restored is not None and restored[0] == 15


def test_a_damaged_local_newest_restores_the_remote_copy_of_that_step(
        tmp_path: Path, config: gdsckpt.Config, remote: str, quiet: None) -> None:
    """Steps 1..3 are saved and uploaded. Step 3's local file is then damaged (truncated by a disk
    fault). ``restore_latest`` must restore step 3 from the remote tier, where it is intact; it
    restored local step 2, throwing away the progress of step 3."""
    manager = CheckpointManager(tmp_path, keep_last=3, config=config, remote=remote)
    for step in (1, 2, 3):
        manager.save(step, _state(step))
    manager.wait()
    assert manager.remote_steps() == [1, 2, 3]
    path = tmp_path / _ckpt(3)
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 100)
    fresh = CheckpointManager(tmp_path, keep_last=3, config=config, remote=remote)
    assert fresh.latest_step() == 3  # what restore_latest picks (it said 2, the older local step)
    restored = fresh.restore_latest()
    assert restored is not None
    assert restored[0] == 3, f"restored step {restored[0]}; the remote tier's step 3 is intact"


def test_remote_pruning_removes_deltas_before_their_bases(tmp_path: Path, config: gdsckpt.Config,
                                                          remote: str) -> None:
    """The remote tier removed objects in listing order, bases first: a process killed between
    two removals left a delta there whose base was gone (local pruning goes highest first)."""
    manager = CheckpointManager(tmp_path, keep_last=1, keep_last_remote=1, delta_every=1, max_chain=2,
                                config=config, remote=remote)
    removed: list[str] = []
    remove = manager.remote.remove

    def recorded_remove(name: str) -> None:
        removed.append(name)
        remove(name)

    manager.remote.remove = recorded_remove  # type: ignore[method-assign]
    for step in range(1, 6):  # 1, 2 (on 1), 3 (on 2); 4 a new chain, 5 on it: 1-3 go
        manager.save(step, _state(step))
        manager.wait(60)
    old_chain = [name for name in removed if name in {_ckpt(1), _ckpt(2), _ckpt(3)}]
    assert old_chain == [_ckpt(3), _ckpt(2), _ckpt(1)]


def test_the_remote_base_cache_never_outlives_an_upload_of_that_name(
        tmp_path: Path, config: gdsckpt.Config, remote: str, quiet: None) -> None:
    """Remote pruning caches each object's base by (name, size), on the assumption that an
    object's content is fixed. A run rolled back in the same process saves a step again and
    uploads it under the same name; a state of the same shapes often makes an object of exactly
    the old size, and then the old object's cached base decided which bases pruning kept (a kept
    delta could lose its base). Here the shapes differ, so the stale entry shows: every cached
    entry must describe the object the server holds now."""
    manager = CheckpointManager(tmp_path, keep_last=2, keep_last_remote=2, config=config, remote=remote,
                                delta_every=1, full_every=4)
    for step in (1, 2, 3):
        manager.save(step, _state(step))
    manager.wait()
    rolled_back = {"w": torch.randn(2100, generator=torch.Generator().manual_seed(20)), "b": torch.zeros(10), "step": 2}
    manager.save(2, rolled_back)  # saved again after a rollback: another object under the same name
    manager.wait()
    objects = ObjectDirectory(remote).names()
    stale = {entry for entry in manager._remote_bases if objects.get(entry[0]) != entry[1]}
    assert not stale, f"cached bases of objects the server no longer holds: {stale}"


def test_restore_from_a_hung_remote_fails_within_config_timeout(tmp_path: Path, server: SeaweedServer,
                                                                 remote: str, quiet: None) -> None:
    """The S3 service stops answering (process frozen with SIGSTOP; TCP still accepts). A replacement
    node's ``restore_latest`` with ``Config(timeout=1)`` fails with a clear error, not after the
    minutes obstore's default client timeouts and retries took (``io.s3.open_store``)."""
    config = gdsckpt.Config(timeout=1.0)
    manager = CheckpointManager(tmp_path / "a", config=config, remote=remote)
    manager.save(1, _state(1))
    manager.wait()
    fresh = CheckpointManager(tmp_path / "b", config=config, remote=remote)
    outcome = _while_frozen(server, fresh.restore_latest)
    assert isinstance(outcome.get("error"), gdsckpt.CheckpointError), outcome  # a clear error, not a fresh start


def _while_frozen(server: SeaweedServer, call: Any) -> dict[str, Any]:
    """Run ``call`` on a thread while the S3 server's process is stopped (SIGSTOP: it accepts
    connections and answers nothing); its ``result`` or ``error``. Fails if it is still running
    15 s later, with every ``Config.timeout`` of the callers 1 s (a hang, not a slow failure)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as err:
            outcome["error"] = err

    assert server._server is not None
    os.kill(server._server.pid, signal.SIGSTOP)
    try:
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(15.0)
        hung = thread.is_alive()
    finally:
        os.kill(server._server.pid, signal.SIGCONT)
    thread.join(120)
    assert not hung, "still blocked 15 s after Config.timeout=1 s on an unresponsive server"
    return outcome


def test_an_objects_only_save_to_a_hung_remote_fails_within_config_timeout(server: SeaweedServer, remote: str,
                                                                           quiet: None) -> None:
    """``CheckpointManager("s3://...")`` saving a 48 MiB state while the S3 service is frozen, with
    ``Config(timeout=1)``: the save fails with a clear error (``S3Writer._enqueue`` used to retry
    forever while the upload thread was alive, and obstore's requests to wait for minutes)."""
    config = gdsckpt.Config(timeout=1.0, max_inflight_bytes=16 << 20)
    manager = CheckpointManager(remote, config=config)
    state = {"w": torch.randn(12 << 20, generator=torch.Generator().manual_seed(0))}
    outcome = _while_frozen(server, lambda: manager.save(1, state, codec="none"))
    assert isinstance(outcome.get("error"), gdsckpt.CheckpointError), outcome


# ---------------------------------------------------------------------------------------------
# passing: a risky combination nothing else covers


def _trained(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3000, generator=g)
    w[: 50 * step] += 0.001 * step  # deltas change part of the weights
    return {"model": {"w": w}, "step": step}


@pytest.mark.parametrize("delta_base", ["previous", "full"])
def test_killed_at_every_publish_and_prune_step_of_a_delta_run_restores_the_newest(
        tmp_path: Path, config: gdsckpt.Config, monkeypatch: pytest.MonkeyPatch, h: Any, delta_base: str) -> None:
    """Coverage nothing else has: deltas (chain or star) with keep_last=1, the process killed before
    each checkpoint rename, each pointer update and each file removal of pruning, in turn. A fresh
    manager then restores the newest renamed step bit-exact, ``latest`` names an existing file, and
    a continued run saves and restores again."""
    import gdsckpt.manager as manager_module

    events: list[str] = []
    kill_at: list[int | None] = [None]
    published: set[int] = set()
    publish, remove = posix.publish, manager_module.remove_releasing

    def point(what: str) -> None:
        events.append(what)
        if kill_at[0] is not None and len(events) - 1 == kill_at[0]:
            raise Killed(what)

    def counted_publish(temp: Path, target: Path, **kwargs: Any) -> None:
        point(f"publish {Path(target).name}")
        publish(temp, target, **kwargs)
        if Path(target).name.startswith("step-"):
            published.add(int(Path(target).name[5:15]))

    def counted_remove(path: Any, *args: Any, **kwargs: Any) -> Any:
        point(f"remove {Path(path).name}")
        return remove(path, *args, **kwargs)

    monkeypatch.setattr(posix, "publish", counted_publish)
    monkeypatch.setattr(manager_module, "remove_releasing", counted_remove)
    options = dict(keep_last=1, config=config, delta_every=1, full_every=3, delta_base=delta_base)

    def run(directory: Path) -> None:
        manager = CheckpointManager(directory, **options)
        for step in range(1, 8):
            manager.save(step, _trained(step))

    run(tmp_path / "dry")
    total = len(events)
    assert total > 15 and any(e.startswith("remove") for e in events)
    for k in range(total):
        events.clear()
        published.clear()
        kill_at[0] = k
        directory = tmp_path / f"kill-{k}"
        with pytest.raises(Killed):
            run(directory)
        kill_at[0] = None
        expected = max(published, default=None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fresh = CheckpointManager(directory, **options)
            restored = fresh.restore_latest()
        if expected is None:
            assert restored is None, (k, events[-1])
            continue
        assert restored is not None and restored[0] == expected, (k, events[-1], restored and restored[0])
        h.assert_same(_trained(expected), restored[1])
        pointer = directory / "latest"
        if pointer.exists():
            assert (directory / pointer.read_text().strip()).exists(), (k, events[-1])
        fresh.save(expected + 1, _trained(expected + 1))
        again = CheckpointManager(directory, **options).restore_latest()
        assert again is not None and again[0] == expected + 1
        h.assert_same(_trained(expected + 1), again[1])


def _delta_state(value: int) -> dict[str, Any]:
    w = torch.zeros(50_000)
    w[:100] = value
    return {"model": {"w": w}, "step": value}


def _saves_of(manager: CheckpointManager, steps: list[int]) -> list[tuple[int, bool]]:
    """Save each step (its state by step) and load it back bit-exact: (step, saved as a delta)."""
    done = []
    for step in steps:
        report = manager.save(step, _delta_state(step))
        loaded = gdsckpt.load(manager.path(step))
        assert torch.equal(loaded["model"]["w"], _delta_state(step)["model"]["w"]), step
        done.append((step, report.base is not None))
    return done


def test_a_step_saved_again_under_a_delta_never_blocks_later_saves(tmp_path: Path, config: gdsckpt.Config) -> None:
    """``save(1000)``, ``save(1100)`` (a delta on 1000), then ``save(1000)`` again: the second 1000
    replaces the base of 1100, by design (a run restarted from an older step writes over the
    abandoned run's files), and ``latest`` stays on 1100. Every later delta save then took 1100 as
    its base, whose own base no longer matched, and failed with ``DeltaBaseError`` (its state
    lost) until the next ``full_every`` step, for ever without one. A base is now chosen only
    when its whole chain resolves, and the second 1000, a rollback, is what ``latest`` names:
    the next steps are deltas on it, each loading bit-exact."""
    manager = CheckpointManager(tmp_path, keep_last=5, config=config, delta_every=100)
    assert _saves_of(manager, [1000, 1100]) == [(1000, False), (1100, True)]
    manager.save(1000, _delta_state(999))
    assert manager.latest_step() == 1000
    assert _saves_of(manager, [1200, 1300, 1400]) == [(1200, True), (1300, True), (1400, True)]
    step, _extra = manager.restore_latest()
    assert step == 1400


def test_a_delta_base_is_never_pruned_while_it_is_being_chosen(tmp_path: Path, config: gdsckpt.Config,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``save_async(3)`` chose step 1 as its base and checked its chain; another save completing
    at that moment (step 2, a full one, ``keep_last=1``) pruned step 1 before the base was
    registered as in use, and the delta failed with ``DeltaBaseError``: step 3 was never saved.
    A candidate is now reserved before it is checked. The other save is run inside the check, the
    window a background save of a ``max_inflight`` > 1 manager hits at random."""
    import gdsckpt.manager as manager_module

    manager = CheckpointManager(tmp_path, keep_last=1, config=config, delta_every=1, full_every=2,
                                max_inflight=2)
    manager.save(1, _delta_state(1))
    original = manager_module._problem
    inside: list[int] = []

    def problem(path: Any, **kwargs: Any) -> Any:
        found = original(path, **kwargs)
        if kwargs.get("chain") and not inside:
            inside.append(1)
            manager.save(2, _delta_state(2))  # complete, and prunes what keep_last=1 lets go
        return found

    monkeypatch.setattr(manager_module, "_problem", problem)
    handle = manager.save_async(3, _delta_state(3))
    monkeypatch.undo()
    report = handle.wait(timeout=60)
    assert inside and report.base is not None and report.base.endswith(_ckpt(1))
    assert torch.equal(gdsckpt.load(manager.path(3))["model"]["w"], _delta_state(3)["model"]["w"])
    manager.save(4, _delta_state(4))  # step 3 completed after 2: the base it used may go now
    assert manager.restore_latest()[0] == 4


@pytest.mark.parametrize("damage", ["chunk bytes", "deleted"])
def test_a_damaged_base_under_the_newest_delta_never_blocks_later_saves(tmp_path: Path, config: gdsckpt.Config,
                                                                        damage: str) -> None:
    """The base of the newest checkpoint (a delta) damaged in its chunk bytes, or deleted: every
    later delta save of this manager, and of a new one, chose the newest checkpoint as its base
    (its header and index read fine) and failed reading it, so no step could be saved until the
    next full one. Now a deleted base is seen when the base is chosen (its chain is resolved), and
    damaged chunks when the delta reads them: that step is saved in full with a
    ``SkippedCheckpointWarning``, and later saves go on as deltas."""
    manager = CheckpointManager(tmp_path, keep_last=5, config=config, delta_every=100)
    _saves_of(manager, [1000, 1100])
    base = manager.path(1000)
    if damage == "deleted":
        base.unlink()
    else:
        data = bytearray(base.read_bytes())
        data[gdsckpt.inspect(base).chunks[0].offset + 10] ^= 0xFF
        base.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = _saves_of(manager, [1200, 1300])
    assert done == [(1200, False), (1300, True)]
    skipped = [str(w.message) for w in caught if issubclass(w.category, gdsckpt.SkippedCheckpointWarning)]
    assert len(skipped) == (1 if damage == "chunk bytes" else 0), skipped
    fresh = CheckpointManager(tmp_path, keep_last=5, config=config, delta_every=100)
    assert _saves_of(fresh, [1400]) == [(1400, True)]


def test_a_background_delta_on_a_damaged_base_leaves_the_next_save_a_full_one(tmp_path: Path,
                                                                               config: gdsckpt.Config) -> None:
    """``save_async`` of a delta whose base's chunks are damaged fails (its handle says why, as a
    ``CorruptCheckpointError``); the next save chose the same base again and failed the same way.
    Now the base is passed over once a background delta found it damaged: the next save is full,
    and the ones after it deltas again."""
    manager = CheckpointManager(tmp_path, keep_last=5, config=config, delta_every=100)
    _saves_of(manager, [1000])
    base = manager.path(1000)
    data = bytearray(base.read_bytes())
    data[gdsckpt.inspect(base).chunks[0].offset + 10] ^= 0xFF
    base.write_bytes(bytes(data))
    with pytest.raises(gdsckpt.CorruptCheckpointError):
        manager.save_async(1100, _delta_state(1100)).wait(timeout=60)
    assert not manager.path(1100).exists()
    report = manager.save_async(1200, _delta_state(1200)).wait(timeout=60)
    assert report.base is None
    assert _saves_of(manager, [1300]) == [(1300, True)]
    assert torch.equal(gdsckpt.load(manager.path(1200))["model"]["w"], _delta_state(1200)["model"]["w"])
    manager.wait(timeout=60)  # the failed save's error was reported by its handle, not again here
