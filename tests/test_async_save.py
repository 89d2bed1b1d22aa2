"""``gdsckpt.save_async``: the snapshot is taken at call time, snapshot buffers are pooled and
reused, background errors surface (and are never lost), at most ``max_inflight`` saves run at
once, and interpreter exit neither loses a save nor leaves a half-written file at the path."""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt.background import async_save
from gdsckpt.io import posix

TEMP_GLOB = ".*.gdsckpt-tmp-*"


@pytest.fixture(autouse=True)
def _no_leftover_saves() -> Any:
    """Every test starts and ends with no background save running and no unreported error."""
    yield
    async_save._default_saver._wait_inflight(60)
    leftover = list(async_save._unobserved)
    async_save._unobserved.clear()
    assert not leftover, f"unreported background errors: {[job.error for job in leftover]}"


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    tied = torch.nn.Parameter(torch.randn(64, 16, generator=g))
    metadata = collections.OrderedDict([("w", torch.randn(300, 40, generator=g)),
                                        ("b", torch.randn(40, generator=g).to(torch.bfloat16))])
    metadata._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    base = torch.randn(30, 20, generator=g)
    return {
        "model": metadata,
        "embed": tied,
        "head": tied,  # the same Parameter twice (tied weights): stored once
        "strided": base.t()[::2],  # a non-contiguous view
        "ints": torch.arange(1000, dtype=torch.int64),
        "mask": torch.rand(77, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "numpy": np.arange(500, dtype=np.float32).reshape(25, 20),
        "np_scalar": np.float64(2.25),
        "list": [torch.ones(3), 1, 2.5, "text", None, True],
        "tuple": (torch.zeros(2, dtype=torch.float16), -7),
        "step": 10,
    }


def _clone(obj: Any) -> Any:
    """A deep copy with fresh tensors (the expected content of the checkpoint)."""
    if isinstance(obj, torch.nn.Parameter):
        return torch.nn.Parameter(obj.detach().clone(), requires_grad=obj.requires_grad)
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, collections.OrderedDict):
        copy = collections.OrderedDict((k, _clone(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            copy._metadata = dict(obj._metadata)  # type: ignore[attr-defined]
        return copy
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone(v) for v in obj)
    return obj


def _mutate(state: dict[str, Any]) -> None:
    """Change every tensor and array in place, and the containers too."""
    with torch.no_grad():
        for value in (state["model"]["w"], state["model"]["b"], state["embed"], state["strided"],
                      state["ints"], state["scalar"], state["list"][0], state["tuple"][0]):
            value.add_(1)
        state["mask"].logical_not_()
    state["numpy"] += 1
    state["list"].append("new")
    state["list"][1] = 100
    state["model"]["extra"] = torch.ones(1)
    state["step"] = 11


def _fake_report(path: Any) -> gdsckpt.SaveReport:
    return gdsckpt.SaveReport(path=str(path), logical_bytes=0, file_bytes=0, ratio=0.0, seconds=0.0,
                              codec="none", backend="fake", engine="fake", tensors=0, chunks=0)


def _wait_until(condition: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


# ---------------------------------------------------------------------------------------------
# snapshot semantics

def test_snapshot_is_taken_at_call_time(ckpt_path: Path, monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    state = _state()
    expected = _clone(state)
    # Hold the background save until the caller has changed everything, so the test does not
    # depend on who wins a race.
    release = threading.Event()
    real_save = gdsckpt.api.saving.save_flat

    def held_save(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(60)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(gdsckpt.api.saving, "save_flat", held_save)
    handle = gdsckpt.save_async(state, ckpt_path, config=h.small_config())
    _mutate(state)
    assert not handle.done()
    release.set()
    report = handle.wait(timeout=60)
    assert handle.done() and handle.exception() is None
    assert report.path == str(ckpt_path) and handle.path == str(ckpt_path)
    assert handle.snapshot_bytes > 0 and handle.snapshot_seconds >= 0

    loaded = gdsckpt.load(ckpt_path)
    h.assert_same(expected, loaded)
    assert loaded["embed"] is loaded["head"], "tied weights must stay one shared tensor"
    infos = {info.key: info for info in gdsckpt.inspect(ckpt_path).tensors}
    assert infos["head"].alias_of == "embed"


def test_snapshot_of_a_training_state_restores_bit_exact(tmp_path: Path) -> None:
    from gdsckpt.demo import bit_equal, train_steps, training_state

    model, optimizer = training_state(width=32, depth=1, steps=2)
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    handle = gdsckpt.save_async({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 2},
                                tmp_path / "train.gdsckpt")
    train_steps(model, optimizer, 2, seed=5)  # keeps training while the save runs
    handle.wait(timeout=60)
    fresh, fresh_optimizer = training_state(width=32, depth=1, steps=0, seed=1)
    target = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    gdsckpt.load_into(target, tmp_path / "train.gdsckpt")
    assert target["step"] == 2
    assert all(bit_equal(expected_model[k], v) for k, v in fresh.state_dict().items())
    assert any(not bit_equal(expected_model[k], v) for k, v in model.state_dict().items())


def test_snapshot_buffers_are_pooled_and_reused(tmp_path: Path, h: Any) -> None:
    async_save.clear_pool()
    state = _state()
    before = async_save.pool_stats()
    first = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", config=h.small_config())
    first.wait(timeout=60)
    after_first = async_save.pool_stats()
    allocated = after_first.allocations - before.allocations
    assert allocated > 0
    assert after_first.allocated_bytes - before.allocated_bytes == first.snapshot_bytes
    assert after_first.held_bytes == first.snapshot_bytes and after_first.lent_bytes == 0

    _mutate(state)
    del state["model"]["extra"]  # the same arrays as before
    second = gdsckpt.save_async(state, tmp_path / "b.gdsckpt", config=h.small_config())
    second.wait(timeout=60)
    after_second = async_save.pool_stats()
    assert after_second.allocations == after_first.allocations, "the second save allocated new buffers"
    assert after_second.allocated_bytes == after_first.allocated_bytes
    assert after_second.reuses - after_first.reuses == allocated
    assert after_second.held_bytes == first.snapshot_bytes
    h.assert_same(_clone(state), gdsckpt.load(tmp_path / "b.gdsckpt"))


def test_prepare_allocates_so_the_first_save_allocates_nothing(tmp_path: Path, h: Any) -> None:
    async_save.clear_pool()
    state = _state()
    held = async_save.prepare(state, config=h.small_config())
    prepared = async_save.pool_stats()
    assert held == prepared.held_bytes > 0 and prepared.lent_bytes == 0
    handle = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", config=h.small_config())
    handle.wait(timeout=60)
    after = async_save.pool_stats()
    assert after.allocations == prepared.allocations, "the first save after prepare() allocated"
    assert after.reuses - prepared.reuses == prepared.buffers and handle.snapshot_bytes == held
    h.assert_same(_clone(state), gdsckpt.load(tmp_path / "a.gdsckpt"))
    manager = gdsckpt.CheckpointManager(tmp_path / "run", keep_last=1, config=h.small_config())
    assert manager.prepare(state) == held and manager.pool_stats().allocations == prepared.buffers
    with pytest.raises(TypeError, match="cannot save"):
        async_save.prepare({"bad": object()})


def test_pool_memory_stays_bounded_when_the_state_changes(tmp_path: Path, h: Any) -> None:
    async_save.clear_pool()
    big = {"a": torch.ones(50_000), "b": np.ones(20_000)}
    small = {"c": torch.ones(1_000), "d": torch.ones(3_000)}
    for _ in range(3):
        gdsckpt.save_async(big, tmp_path / "big.gdsckpt", config=h.small_config()).wait(timeout=60)
        assert async_save.pool_stats().held_bytes == 50_000 * 4 + 20_000 * 8
        handle = gdsckpt.save_async(small, tmp_path / "small.gdsckpt", config=h.small_config())
        handle.wait(timeout=60)
        # the buffers of the big state are dropped: the pool holds one snapshot of what it saves now
        assert async_save.pool_stats().held_bytes == handle.snapshot_bytes == 4_000 * 4
    assert async_save.clear_pool() == 4_000 * 4
    assert async_save.pool_stats().held_bytes == 0


def test_unsupported_state_and_bad_path_fail_in_the_caller(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="object"):
        gdsckpt.save_async({"bad": object()}, tmp_path / "x.gdsckpt")
    with pytest.raises(FileNotFoundError):
        gdsckpt.save_async({"w": torch.ones(2)}, tmp_path / "missing" / "x.gdsckpt")
    with pytest.raises(ValueError, match="max_inflight"):
        gdsckpt.save_async({"w": torch.ones(2)}, tmp_path / "x.gdsckpt", max_inflight=0)
    assert async_save._default_saver.inflight == 0 and async_save.pool_stats().lent_bytes == 0
    gdsckpt.save_async({"w": torch.ones(2)}, tmp_path / "x.gdsckpt").wait(timeout=60)
    assert not list(tmp_path.glob(TEMP_GLOB))


# ---------------------------------------------------------------------------------------------
# errors

def test_background_write_error_surfaces_on_wait(ckpt_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 h: Any) -> None:
    gdsckpt.save({"w": torch.arange(10.0)}, ckpt_path, config=h.small_config())
    previous = ckpt_path.read_bytes()

    def no_space(fd: int, data: Any, offset: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(posix, "pwrite_all", no_space)
    handle = gdsckpt.save_async(_state(), ckpt_path, config=h.small_config(fsync=True))
    with pytest.raises(OSError) as caught:
        handle.wait(timeout=60)
    assert caught.value.errno == errno.ENOSPC
    assert handle.exception() is caught.value
    assert handle.done()
    assert ckpt_path.read_bytes() == previous
    assert sorted(p.name for p in ckpt_path.parent.iterdir()) == [ckpt_path.name], "temporary file left"
    assert async_save.pool_stats().lent_bytes == 0, "a failed save must give its buffers back"


def test_dropped_handle_error_is_logged_and_raised_by_the_next_save_async(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def failing_save(state: Any, path: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "no space (injected)")

    monkeypatch.setattr(gdsckpt.api.saving, "save_flat", failing_save)
    with caplog.at_level(logging.ERROR, logger="gdsckpt"):
        gdsckpt.save_async({"w": torch.ones(3)}, tmp_path / "dropped.gdsckpt")  # handle dropped at once
        _wait_until(lambda: async_save._default_saver.inflight == 0, "the failing save")
    assert any("dropped.gdsckpt" in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    with pytest.raises(OSError, match="injected") as caught:
        gdsckpt.save_async({"w": torch.ones(3)}, tmp_path / "next.gdsckpt")
    assert caught.value.errno == errno.ENOSPC
    assert not (tmp_path / "next.gdsckpt").exists(), "the call that raised must not start a save"
    gdsckpt.save_async({"w": torch.ones(3)}, tmp_path / "next.gdsckpt").wait(timeout=60)  # reported once


def test_wait_all_raises_unreported_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    def failing_save(state: Any, path: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected failure for {Path(path).name}")

    monkeypatch.setattr(gdsckpt.api.saving, "save_flat", failing_save)
    kept = gdsckpt.save_async({"w": torch.ones(3)}, tmp_path / "kept.gdsckpt")
    with caplog.at_level(logging.ERROR, logger="gdsckpt"):
        gdsckpt.save_async({"w": torch.ones(3)}, tmp_path / "dropped.gdsckpt", max_inflight=2)
        with pytest.raises(RuntimeError, match="injected failure"):
            gdsckpt.wait_all(timeout=60)
    gdsckpt.wait_all(timeout=60)  # reported once
    assert isinstance(kept.exception(), RuntimeError)  # the handle still has it


def _hold_saves(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make background saves wait until the returned event is set (then report success without
    writing): a save that stays in flight as long as a test needs."""
    release = threading.Event()

    def held_save(state: Any, path: Any, **kwargs: Any) -> Any:
        assert release.wait(60)
        return _fake_report(path)

    monkeypatch.setattr(gdsckpt.api.saving, "save_flat", held_save)
    return release


def test_wait_timeout_and_done(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = _hold_saves(monkeypatch)
    handle = gdsckpt.save_async({"w": torch.ones(3)}, tmp_path / "held.gdsckpt")
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.01)
    assert not handle.done() and "running" in repr(handle)
    release.set()
    assert handle.wait(timeout=60).backend == "fake"
    assert handle.done() and "done" in repr(handle)


# ---------------------------------------------------------------------------------------------
# max_inflight

@pytest.mark.parametrize("max_inflight", [1, 2])
def test_max_inflight_bounds_saves_in_flight(max_inflight: int, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[tuple[str, str]] = []
    lock = threading.Lock()
    release = threading.Event()

    def record(event: str, name: str) -> None:
        with lock:
            log.append((event, name))

    def held_save(state: Any, path: Any, **kwargs: Any) -> Any:
        name = Path(path).stem
        record("start", name)
        if name == "a":
            assert release.wait(60)
        record("end", name)
        return _fake_report(path)

    monkeypatch.setattr(gdsckpt.api.saving, "save_flat", held_save)
    saver = async_save._default_saver
    first = gdsckpt.save_async({"w": torch.ones(3)}, tmp_path / "a.gdsckpt", max_inflight=max_inflight)
    handles: list[Any] = []

    def second_call() -> None:
        record("call", "b")
        handles.append(gdsckpt.save_async({"w": torch.ones(3)}, tmp_path / "b.gdsckpt",
                                          max_inflight=max_inflight))
        record("returned", "b")

    caller = threading.Thread(target=second_call)
    caller.start()
    if max_inflight == 1:
        _wait_until(lambda: saver.waiting == 1, "the second call to block")
        with lock:
            assert ("start", "b") not in log and ("returned", "b") not in log
        assert saver.inflight == 1
    else:
        _wait_until(lambda: ("end", "b") in log, "the second save to run alongside the first")
        assert saver.waiting == 0
    release.set()
    caller.join(60)
    first.wait(timeout=60)
    handles[0].wait(timeout=60)
    order = {event: i for i, event in enumerate(log)}
    if max_inflight == 1:
        # the second call returned, and its save started, only after the first save ended
        assert order[("end", "a")] < order[("returned", "b")]
        assert order[("end", "a")] < order[("start", "b")]
    else:
        assert order[("end", "b")] < order[("end", "a")]


def test_inflight_wait_gives_up_after_the_config_timeout(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    release = _hold_saves(monkeypatch)
    first = gdsckpt.save_async({"w": torch.ones(3)}, tmp_path / "a.gdsckpt")
    with pytest.raises(TimeoutError, match="still in flight"):
        gdsckpt.save_async({"w": torch.ones(3)}, tmp_path / "b.gdsckpt", config=gdsckpt.Config(timeout=0.05))
    assert async_save._default_saver.inflight == 1 and async_save.pool_stats().lent_bytes == 3 * 4
    release.set()
    first.wait(timeout=60)


# ---------------------------------------------------------------------------------------------
# interpreter exit

_EXIT_SCRIPT = """
import sys, time
import numpy as np
import gdsckpt
from gdsckpt.io import posix

path, mode = sys.argv[1], sys.argv[2]
gdsckpt.save({"a": np.zeros(100_000, dtype=np.float32)}, path)  # the previous content
if mode == "stuck":
    commit = posix.PosixWriter.commit
    def slow_commit(self):  # complete in the temporary file, never renamed before exit
        time.sleep(30)
        commit(self)
    posix.PosixWriter.commit = slow_commit
config = gdsckpt.Config(chunk_bytes=65536, timeout=0.5 if mode == "stuck" else 600)
gdsckpt.save_async({"a": np.arange(100_000, dtype=np.float32), "step": 2}, path, config=config)
print("returned", flush=True)
"""


def test_exit_waits_for_a_save_in_flight(tmp_path: Path, h: Any) -> None:
    path = tmp_path / "exit.gdsckpt"
    result = h.run_python("-c", _EXIT_SCRIPT, str(path), "finish", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "returned" in result.stdout
    loaded = gdsckpt.load(path)
    assert loaded["step"] == 2 and np.array_equal(loaded["a"], np.arange(100_000, dtype=np.float32))
    assert not list(tmp_path.glob(TEMP_GLOB))


def test_exit_abandons_a_stuck_save_and_the_path_keeps_its_previous_content(tmp_path: Path, h: Any) -> None:
    path = tmp_path / "exit.gdsckpt"
    started = time.monotonic()
    result = h.run_python("-c", _EXIT_SCRIPT, str(path), "stuck", timeout=120)
    assert time.monotonic() - started < 25, "exit must not wait for the stuck save"
    assert result.returncode == 0, result.stderr
    assert "abandoning the background save" in result.stderr
    loaded = gdsckpt.load(path)  # the previous, complete file
    assert np.array_equal(loaded["a"], np.zeros(100_000, dtype=np.float32)) and "step" not in loaded
    # The abandoned temporary file (if the process left one) belongs to a dead process: the next
    # save to the path removes it.
    gdsckpt.save({"a": np.ones(3)}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def _slowed_saves(monkeypatch: pytest.MonkeyPatch, slow_path: Path) -> None:
    """Fault injection: the background save to ``slow_path`` takes 0.5 s longer (as a large state
    would); every other save runs as it is."""
    from gdsckpt.api import saving

    real = saving.save_flat

    def slowed(flat: Any, path: Any, **options: Any) -> Any:
        if Path(str(path)) == slow_path:
            time.sleep(0.5)
        return real(flat, path, **options)

    monkeypatch.setattr(saving, "save_flat", slowed)


def test_saves_in_flight_to_one_file_complete_in_call_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ``save_async`` calls to one path with ``max_inflight=2``: the second finished first and
    the first's rename then replaced it, so the file held the older state while both handles
    reported success. A save whose file an earlier one in flight writes now waits for it."""
    path = tmp_path / "c.gdsckpt"
    _slowed_saves(monkeypatch, path)
    first = gdsckpt.save_async({"step": 1, "x": torch.ones(1000)}, path, max_inflight=2)
    second = gdsckpt.save_async({"step": 2, "x": torch.zeros(10)}, path, max_inflight=2)
    assert first.done(), "the second call returns only once the first save to the file has ended"
    second.wait(60)
    first.wait(60)
    assert gdsckpt.load(path)["step"] == 2


def test_a_delta_on_a_file_being_saved_waits_for_that_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``save_async(s1, a)`` then ``save_async(s2, b, base=a)`` with ``max_inflight=2``: the delta
    was written against the ``a`` on disk before the first save replaced it, both handles reported
    success, and ``load(b)`` raised ``DeltaBaseError``: b was lost. The delta now waits for the
    save of its base; and a save replacing a base that a delta in flight reads waits for the delta,
    then is refused as a save over a base is (``DeltaBaseError``) unless ``force``."""
    a, b = tmp_path / "a.gdsckpt", tmp_path / "b.gdsckpt"
    g = torch.Generator().manual_seed(3)
    s0 = {"w": torch.randn(20_000, generator=g)}
    s1 = {"w": s0["w"] + 1}
    s2 = {"w": s1["w"].clone()}
    s2["w"][::50] += 1
    gdsckpt.save(s0, a)
    _slowed_saves(monkeypatch, a)
    gdsckpt.save_async(s1, a, max_inflight=2)
    report = gdsckpt.save_async(s2, b, base=a, max_inflight=2).wait(60)
    assert report.base is not None
    assert torch.equal(gdsckpt.load(b)["w"], s2["w"]) and torch.equal(gdsckpt.load(a)["w"], s1["w"])

    d, c = tmp_path / "d.gdsckpt", tmp_path / "c.gdsckpt"  # d: a base no delta on disk uses yet
    gdsckpt.save(s1, d)
    _slowed_saves(monkeypatch, c)
    delta = gdsckpt.save_async(s2, c, base=d, max_inflight=2)
    with pytest.raises(gdsckpt.DeltaBaseError):
        gdsckpt.save_async(s0, d, max_inflight=2)
    assert delta.done()
    assert torch.equal(gdsckpt.load(c)["w"], s2["w"]) and torch.equal(gdsckpt.load(d)["w"], s1["w"])


def test_a_blocking_save_waits_for_a_save_async_it_shares_a_file_with(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``gdsckpt.save`` (and ``convert``) ignored ``save_async`` calls still in flight: a save over
    the base of a delta in flight replaced it, so the delta, reported saved, never loaded; a delta
    on a file being saved was written against the old file; a save to the same file could be
    replaced by the older background save. Each now waits for the save it shares a file with."""
    g = torch.Generator().manual_seed(5)
    s0 = {"w": torch.randn(20_000, generator=g)}
    s1 = {"w": s0["w"] + 1}
    s2 = {"w": s1["w"].clone()}
    s2["w"][::50] += 1

    base, delta = tmp_path / "base.gdsckpt", tmp_path / "delta.gdsckpt"
    gdsckpt.save(s1, base)
    _slowed_saves(monkeypatch, delta)
    handle = gdsckpt.save_async(s2, delta, base=base)
    with pytest.raises(gdsckpt.DeltaBaseError):  # waited for the delta, which now depends on base
        gdsckpt.save(s0, base)
    assert handle.done()
    assert torch.equal(gdsckpt.load(delta)["w"], s2["w"]) and torch.equal(gdsckpt.load(base)["w"], s1["w"])

    a, b = tmp_path / "a.gdsckpt", tmp_path / "b.gdsckpt"
    gdsckpt.save(s0, a)
    _slowed_saves(monkeypatch, a)
    handle = gdsckpt.save_async(s1, a)
    report = gdsckpt.save(s2, b, base=a)  # written against the a that the background save wrote
    assert handle.done() and report.base is not None
    assert torch.equal(gdsckpt.load(b)["w"], s2["w"]) and torch.equal(gdsckpt.load(a)["w"], s1["w"])

    same = tmp_path / "same.gdsckpt"
    _slowed_saves(monkeypatch, same)
    handle = gdsckpt.save_async(s1, same)
    gdsckpt.save(s2, same)
    assert handle.done() and torch.equal(gdsckpt.load(same)["w"], s2["w"])

    source, copy = tmp_path / "source.gdsckpt", tmp_path / "copy.gdsckpt"
    gdsckpt.save(s0, source)
    _slowed_saves(monkeypatch, source)
    handle = gdsckpt.save_async(s1, source)
    gdsckpt.convert(source, copy, codec="lz4")
    assert handle.done() and torch.equal(gdsckpt.load(copy)["w"], s1["w"])


def test_save_async_writes_a_relative_path_where_it_was_called(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative path was resolved when the background thread wrote it: an ``os.chdir`` right
    after the call put the checkpoint in the new directory, without an error."""
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    monkeypatch.chdir(here)
    _slowed_saves(monkeypatch, here / "rel.gdsckpt")
    handle = gdsckpt.save_async({"x": torch.arange(5.0)}, "rel.gdsckpt")
    monkeypatch.chdir(there)
    handle.wait(60)
    assert (here / "rel.gdsckpt").is_file() and not (there / "rel.gdsckpt").exists()
    assert torch.equal(gdsckpt.load(here / "rel.gdsckpt")["x"], torch.arange(5.0))


def test_a_delta_opened_by_a_relative_path_reads_its_base_after_a_chdir(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``gdsckpt.open("run/delta.gdsckpt")`` resolves its base when it first reads: after an
    ``os.chdir`` that read looked for the base in the wrong directory (``DeltaBaseError``)."""
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(tmp_path)
    full = {"w": torch.arange(1000.0)}
    gdsckpt.save(full, "run/full.gdsckpt")
    changed = {"w": full["w"].clone()}
    changed["w"][::7] = -1
    gdsckpt.save(changed, "run/delta.gdsckpt", base="run/full.gdsckpt")
    with gdsckpt.open("run/delta.gdsckpt") as ckpt:
        monkeypatch.chdir(run)
        assert torch.equal(ckpt.get("w"), changed["w"])


class _ThreadingWith:
    """The ``threading`` module as ``async_save`` sees it, with another ``Thread`` (fault injection
    for the one thread a ``save_async`` starts; every other thread is left alone)."""

    def __init__(self, thread_class: type) -> None:
        self.Thread = thread_class

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)


def test_an_interrupt_while_save_async_starts_its_thread_leaves_that_save_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ^C while ``Thread.start`` waited for the save's thread, which it had already made: the
    caller returned the snapshot buffers to the pool and ended the job, yet the thread ran on.
    The next ``save_async`` of a state of the same shapes copied into those buffers under it, and
    the first file held the second state, checksums and all. Now the thread keeps the job."""
    a, b = tmp_path / "a.gdsckpt", tmp_path / "b.gdsckpt"
    s1, s2 = {"w": torch.arange(100_000.0)}, {"w": -torch.arange(100_000.0)}

    class StartedThenInterrupted(threading.Thread):
        def start(self) -> None:
            super().start()
            raise KeyboardInterrupt

    _slowed_saves(monkeypatch, a)  # the first save's thread reads its snapshot after the second call
    monkeypatch.setattr(async_save, "threading", _ThreadingWith(StartedThenInterrupted))
    with pytest.raises(KeyboardInterrupt):
        gdsckpt.save_async(s1, a)
    monkeypatch.setattr(async_save, "threading", threading)
    gdsckpt.save_async(s2, b).wait(60)
    gdsckpt.wait_all(60)
    assert torch.equal(gdsckpt.load(a)["w"], s1["w"]) and torch.equal(gdsckpt.load(b)["w"], s2["w"])


def test_an_interrupt_before_save_async_starts_its_thread_ends_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ^C while the save's handle or thread was being made (after the job joined the saver's
    saves in flight): the job never ended, ``wait_all()`` blocked for ever and every later
    ``save_async`` failed after ``Config.timeout``."""

    class NotMade(threading.Thread):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr(async_save, "threading", _ThreadingWith(NotMade))
    with pytest.raises(KeyboardInterrupt):
        gdsckpt.save_async({"w": torch.ones(10)}, tmp_path / "a.gdsckpt")
    monkeypatch.setattr(async_save, "threading", threading)
    gdsckpt.wait_all(5)
    gdsckpt.save_async({"w": torch.zeros(10)}, tmp_path / "b.gdsckpt",
                       config=gdsckpt.Config(timeout=5)).wait(60)
    assert not (tmp_path / "a.gdsckpt").exists() and torch.equal(gdsckpt.load(tmp_path / "b.gdsckpt")["w"],
                                                                   torch.zeros(10))


def test_an_interrupt_before_the_chunk_stream_leaves_no_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ^C after the save made its writer (the temporary file open) but before the chunk stream
    began (here while the index template is made): nothing aborted the writer, and the temporary
    file and its descriptors stayed for the life of the process."""
    from gdsckpt.api import saving

    path = tmp_path / "c.gdsckpt"
    gdsckpt.save({"w": torch.ones(10)}, path)

    def interrupted(*_args: Any, **_kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(saving, "index_template", interrupted)
    descriptors = len(os.listdir("/proc/self/fd"))
    with pytest.raises(KeyboardInterrupt):
        gdsckpt.save({"w": torch.zeros(10)}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.gdsckpt"]
    assert len(os.listdir("/proc/self/fd")) <= descriptors
    assert torch.equal(gdsckpt.load(path)["w"], torch.ones(10))


def test_an_interrupt_as_a_lane_hands_a_task_to_its_pool_does_not_stall_its_close(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A ^C inside the hand-off of a task to the pool (then a ``WorkerPool.put`` call, in Python):
    the lane had counted the task as running, so its close (a writer's abort) waited its whole
    timeout for a task that never existed. The hand-off's one Python call now comes before the
    count and the queue's C put; an interrupt there leaves neither."""
    import types

    from gdsckpt.io import pools

    lane = pools.Lane("io", 2)
    lane.submit(lambda: None).result(10)  # the lane has its pool

    def interrupted(*_args: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(pools, "functools", types.SimpleNamespace(partial=interrupted))
    with pytest.raises(KeyboardInterrupt):
        lane.submit(lambda: None)
    monkeypatch.undo()
    assert lane.submit(lambda: 7).result(10) == 7
    assert lane.close(5.0)  # False once the 5 s pass with a phantom task still counted


FORK_CHILD_CHECK = """
import os, sys, time
import numpy as np
import gdsckpt
from gdsckpt.api import saving

directory = sys.argv[1]
real = saving.save_flat
def slowed(flat, path, **options):
    time.sleep(1.0)
    return real(flat, path, **options)
saving.save_flat = slowed
handle = gdsckpt.save_async({"w": np.arange(1000.0)}, os.path.join(directory, "parent.gdsckpt"))
pid = os.fork()
if pid == 0:
    code = 1
    try:
        gdsckpt.wait_all(5)  # the parent's save is not the child's to wait for
        saving.save_flat = real
        gdsckpt.save_async({"w": np.ones(10)}, os.path.join(directory, "child.gdsckpt"),
                           config=gdsckpt.Config(timeout=5)).wait(30)
        code = 0
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
handle.wait(60)
print("child", os.waitstatus_to_exitcode(status))
"""


def test_a_child_forked_while_a_save_async_runs_saves_on_its_own(tmp_path: Path) -> None:
    """``os.fork`` while a ``save_async`` was in flight: the child inherited the saver's save in
    flight but not its thread, so there ``wait_all()`` blocked for ever and a ``save_async``
    failed after ``Config.timeout``. Run in a fresh NumPy-only interpreter (the fork)."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", FORK_CHILD_CHECK, str(tmp_path)], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0 and child.stdout.strip().endswith("child 0"), (child.stdout, child.stderr[-2000:])
    assert np.array_equal(gdsckpt.load(tmp_path / "parent.gdsckpt")["w"], np.arange(1000.0))
    assert np.array_equal(gdsckpt.load(tmp_path / "child.gdsckpt")["w"], np.ones(10))


def test_an_interrupt_as_the_latest_pointer_is_published_leaves_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``write_atomically`` (the manager's ``latest``): a ^C as ``publish`` began left the complete
    temporary file, which no later save of this (live) process removes."""
    target = tmp_path / "latest"
    target.write_bytes(b"step-1")

    def interrupted(*_args: Any, **_kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(posix, "publish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        posix.write_atomically(target, b"step-2", fsync=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"] and target.read_bytes() == b"step-1"


@pytest.mark.parametrize("arguments", [{"lossy": {"*.exp_avg": 2}}, {"lossy": "abc"}, {"codec": "bogus"},
                                       {"chunk_bytes": 5}, {"config": "fast"}])
def test_arguments_a_save_refuses_are_refused_by_save_async_at_the_call(tmp_path: Path,
                                                                      arguments: dict[str, Any]) -> None:
    """``save_async`` copied the snapshot and returned a handle for arguments ``save`` refuses at
    once; the error came from ``wait()`` or a later call, and the first steps' checkpoints were
    missing. Now they raise at the call, and nothing is written or left in flight."""
    state = {"optimizer": {"exp_avg": torch.randn(1000)}}
    with pytest.raises((ValueError, TypeError)):
        gdsckpt.save_async(state, tmp_path / "a.gdsckpt", **arguments)
    async_save.wait_all(timeout=30)  # nothing in flight, nothing failed in the background
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("lossy", [{"*.exp_avg": 2}, "abc", 5])
def test_a_manager_refuses_a_lossy_policy_every_save_would_refuse(tmp_path: Path, lossy: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        gdsckpt.CheckpointManager(tmp_path / "run", lossy=lossy)


def test_a_snapshot_of_arrays_of_new_sizes_keeps_the_pool_within_its_bound() -> None:
    """The pool dropped the idle buffers of a previous state's sizes only when the next snapshot
    was released: while a save of a state whose arrays changed size ran, the pool held both
    states (128 MiB for a 64 MiB state at ``max_inflight=1``). It now drops them as it allocates."""
    from gdsckpt.background.snapshot import SnapshotPool, take_snapshot

    pool = SnapshotPool()
    first = {f"w{i}": torch.zeros(1000 + i) for i in range(8)}
    second = {f"w{i}": torch.zeros(2000 + i) for i in range(4)}  # the same bytes in other sizes
    total = sum(t.numel() * 4 for t in second.values())
    assert sum(t.numel() * 4 for t in first.values()) > total - 64
    _copy, lent, _nbytes = take_snapshot(first, pool)
    pool.release(lent, copies=1)
    copy, lent, nbytes = take_snapshot(second, pool)
    assert pool.stats().held_bytes <= max(nbytes, sum(t.numel() * 4 for t in first.values()))
    assert all(torch.equal(copy[key], second[key]) for key in second)
    pool.release(lent, copies=1)
    _again, lent, _nbytes = take_snapshot(second, pool)  # the same sizes: every buffer reused
    assert pool.stats().allocations == 8 + 4 and pool.stats().held_bytes == total
    pool.release(lent, copies=1)
