"""``gdsckpt.collector.paused``: the cyclic garbage collector is off while gdsckpt builds the
objects of an index or a structure (the full collections it set off walked the whole heap, the
caller's state included, for nothing: about half of a 100,000-tensor save or load), and exactly
as the caller had it afterwards, whatever happens in between."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch

import gdsckpt
from gdsckpt import collector
from gdsckpt.format import index as index_module
from gdsckpt.state import tree as tree_module


def thresholds_seen_by(monkeypatch: pytest.MonkeyPatch, name: str, *owners: object) -> list[tuple[int, int, int]]:
    """Replace function ``name`` of each of ``owners`` (the same function, imported by name into
    each) with one that records the collector's thresholds when called; returns the records."""
    seen: list[tuple[int, int, int]] = []
    original = getattr(owners[0], name)

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(gc.get_threshold())
        return original(*args, **kwargs)

    for owner in owners:
        monkeypatch.setattr(owner, name, spy)
    return seen


class OtherThread:
    """Another thread inside ``hold()`` from ``start()`` (which returns once it is inside) until
    ``end()``."""

    def __init__(self, hold: Callable[[], AbstractContextManager[object]]):
        self._inside, self._release = threading.Event(), threading.Event()

        def run() -> None:
            with hold():
                self._inside.set()
                self._release.wait(30)

        self._thread = threading.Thread(target=run)

    def start(self) -> None:
        self._thread.start()
        assert self._inside.wait(30)

    def end(self) -> None:
        self._release.set()
        self._thread.join(30)


@pytest.fixture(autouse=True)
def collector_enabled() -> Iterator[None]:
    """Each test starts with the collector on and its thresholds as they were, and leaves them so
    (checked: a test that left them otherwise fails)."""
    assert gc.isenabled()
    before = gc.get_threshold()
    yield
    left = gc.isenabled(), gc.get_threshold()
    gc.enable()
    gc.set_threshold(*before)
    assert left == (True, before), f"the collector was left {left}, not (True, {before})"


def test_a_pause_turns_the_collector_off_and_back_on_also_after_an_error() -> None:
    with collector.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), collector.paused():
        raise KeyError("x")
    assert gc.isenabled()
    with collector.paused():
        with collector.paused():
            assert not gc.isenabled()
        assert gc.isenabled()  # a nested pause's end ends its thread's pause: time, not correctness
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off() -> None:
    gc.disable()
    with collector.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
    gc.enable()


def test_overlapping_pauses_of_two_threads_end_with_the_last() -> None:
    other = OtherThread(collector.paused)
    with collector.paused():
        other.start()
    assert not gc.isenabled()  # the other thread's pause goes on
    other.end()
    assert gc.isenabled()


@pytest.mark.parametrize("step", ["before-its-bookkeeping", "before-gc.enable"])
def test_an_end_a_ctrl_c_interrupted_is_mended_by_the_next_pause(step: str) -> None:
    """Fault injection: the states a ^C landing inside ``_end`` would leave (its thread still
    counted as pausing; or none, and the collector off because of a pause). Before, a count
    that an interrupted end never lowered kept the collector off for good."""
    me = threading.get_ident()
    collector._begin(me)
    if step == "before-gc.enable":
        with collector._lock:
            collector._pausing.discard(me)
    assert not gc.isenabled()
    with collector.paused():
        pass
    assert gc.isenabled() and not collector._pausing


def test_a_thread_that_ended_inside_a_pause_does_not_keep_the_collector_off() -> None:
    thread = threading.Thread(target=lambda: collector._begin(threading.get_ident()))
    thread.start()
    thread.join(30)
    assert not gc.isenabled()
    with collector.paused():
        pass
    assert gc.isenabled()


def test_a_signal_handler_pausing_inside_the_bookkeeping_does_not_wait_for_itself() -> None:
    """A handler that saves runs in the thread it interrupted, maybe inside ``_begin`` or
    ``_end`` with the lock held (a plain lock waited for itself there)."""
    finished = threading.Event()

    def handler_inside_the_bookkeeping() -> None:
        with collector._lock, collector.paused():
            pass
        finished.set()

    thread = threading.Thread(target=handler_inside_the_bookkeeping, daemon=True)
    thread.start()
    assert finished.wait(10), "the pause waited for a lock its own thread held"
    thread.join(10)
    assert gc.isenabled()


def test_saves_and_loads_build_their_index_and_structure_with_the_collector_paused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, bool] = {}

    def spying(name: str, original):  # type: ignore[no-untyped-def]
        def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
            seen[name] = gc.isenabled()
            return original(*args, **kwargs)
        return spy

    monkeypatch.setattr(index_module, "_parse_tensors", spying("parse", index_module._parse_tensors))
    monkeypatch.setattr(tree_module._Flattener, "visit", spying("flatten", tree_module._Flattener.visit))
    monkeypatch.setattr(tree_module, "_build_all", spying("unflatten", tree_module._build_all))
    state = {f"layer{i}": {"w": torch.randn(5), "b": torch.randn(2)} for i in range(50)}
    gdsckpt.save(state, tmp_path / "s.gdsckpt")
    loaded = gdsckpt.load(tmp_path / "s.gdsckpt")
    assert gc.isenabled()
    assert seen == {"parse": False, "flatten": False, "unflatten": False}, seen
    assert all(torch.equal(loaded[k]["w"], state[k]["w"]) for k in state)
    (tmp_path / "bad.gdsckpt").write_bytes(b"not a checkpoint" * 300)
    with pytest.raises(gdsckpt.CheckpointError):
        gdsckpt.load(tmp_path / "bad.gdsckpt")
    assert gc.isenabled()


# ``young_only``: a whole save or restore defers full collections by a budget its own objects set.

def _extra(objects: int) -> int:
    """The middle-generation collections ``objects`` long-lived objects set off."""
    young, middle, _oldest = gc.get_threshold()
    return objects // (young * middle)


def test_a_hold_defers_full_collections_by_its_budget_and_restores_the_threshold_also_after_an_error() -> None:
    before = gc.get_threshold()
    objects = 1_000_000
    with collector.young_only(objects):
        assert gc.get_threshold() == (before[0], before[1], before[2] + _extra(objects))
        collector.expect(objects)
        assert gc.get_threshold() == (before[0], before[1], before[2] + _extra(2 * objects))
        assert gc.isenabled()
    assert gc.get_threshold() == before
    with pytest.raises(KeyError), collector.young_only(objects):
        raise KeyError("x")
    assert gc.get_threshold() == before and not collector._deferring
    collector.expect(objects)  # no hold in this thread: nothing
    assert gc.get_threshold() == before


def test_a_save_of_few_tensors_defers_nothing_and_one_of_many_defers(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A long save of a few large tensors must not hold the cyclic garbage other threads make
    for its whole length (a deferral without a budget held 40 times the usual garbage)."""
    from gdsckpt.api import saving

    before = gc.get_threshold()
    seen = thresholds_seen_by(monkeypatch, "run_save", saving)
    gdsckpt.save({f"t{i}": torch.randn(16384) for i in range(64)}, tmp_path / "few.gdsckpt", chunk_bytes="64KiB")
    gdsckpt.save({f"t{i}": torch.randn(2) for i in range(20_000)}, tmp_path / "many.gdsckpt")
    assert seen[0] == before, "64 tensors deferred full collections"
    assert seen[1][2] > before[2] + 10, seen
    assert gc.get_threshold() == before


def test_thresholds_the_caller_sets_inside_a_hold_are_theirs_afterwards() -> None:
    before = gc.get_threshold()
    try:
        with collector.young_only(1_000_000):
            gc.set_threshold(500)  # the young generation's only
        assert gc.get_threshold() == (500, before[1], before[2]), "the hold's deferral stayed"
        with collector.young_only(1_000_000):
            gc.set_threshold(500, 5, 5)
        assert gc.get_threshold() == (500, 5, 5)
        with collector.young_only(1_000_000):  # a hold after them defers from the caller's
            assert gc.get_threshold()[2] == 5 + 1_000_000 // 2500
        assert gc.get_threshold() == (500, 5, 5)
    finally:
        gc.set_threshold(*before)


def test_overlapping_holds_of_two_threads_add_up_and_end_with_the_last() -> None:
    before = gc.get_threshold()
    other = OtherThread(lambda: collector.young_only(700_000))
    with collector.young_only(1_400_000):
        other.start()
        assert gc.get_threshold()[2] == before[2] + _extra(2_100_000)
    assert gc.get_threshold()[2] == before[2] + _extra(700_000)  # the other thread's hold goes on
    other.end()
    assert gc.get_threshold() == before


@pytest.mark.parametrize("where", ["young_only", "paused"])
def test_an_end_interrupted_by_a_signal_handler_is_finished_before_its_exception_goes_on(
        where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ^C inside an end's own bookkeeping left the thread's hold (or pause) behind; another
    thread's end does not mend one whose thread still runs, so it outlasted the call."""
    before = gc.get_threshold()
    raised: list[bool] = []
    name = "set_threshold" if where == "young_only" else "enable"
    original = getattr(collector.gc, name)

    def interrupted_once(*args):  # type: ignore[no-untyped-def]
        if not raised:
            raised.append(True)
            raise KeyboardInterrupt
        return original(*args)

    hold = collector.young_only(1_000_000) if where == "young_only" else collector.paused()
    with pytest.raises(KeyboardInterrupt), hold:  # the end of the hold is what raises
        monkeypatch.setattr(collector.gc, name, interrupted_once)
    monkeypatch.undo()
    assert raised
    assert gc.get_threshold() == before and gc.isenabled()
    assert not collector._deferring and not collector._pausing


def test_a_thread_that_ended_inside_a_hold_does_not_keep_full_collections_deferred() -> None:
    before = gc.get_threshold()

    def hold_and_end_without_its_end() -> None:
        with collector._lock:
            collector._deferring[threading.get_ident()] = 1_000_000
            collector._apply_deferral()

    thread = threading.Thread(target=hold_and_end_without_its_end)
    thread.start()
    thread.join(30)
    assert gc.get_threshold()[2] > before[2]
    with collector.young_only():
        pass
    assert gc.get_threshold() == before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork of a process with threads (3.12+)
def test_a_child_forked_during_another_threads_hold_collects_fully() -> None:
    before = gc.get_threshold()
    other = OtherThread(lambda: collector.young_only(1_000_000))
    other.start()
    try:
        child = os.fork()
        if child == 0:  # pragma: no cover - the child's verdict is its exit status
            os._exit(0 if gc.get_threshold() == before and not collector._deferring else 1)
        _pid, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child kept full collections deferred"
    finally:
        other.end()
    assert gc.get_threshold() == before


def test_a_save_and_a_load_of_many_tensors_run_no_full_collection(tmp_path: Path) -> None:
    """Before, the objects a save or a load leaves alive per tensor (its records, sources,
    segments) set off full collections in the call, each walking the whole process."""
    state = {f"layer{i // 100}.p{i % 100}": torch.full((1 + i % 7,), float(i)) for i in range(40_000)}
    full: list[str] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(threading.current_thread().name)

    young: list[int] = []

    def count_young(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 0:
            young.append(1)

    gc.collect()
    gc.callbacks += [count, count_young]
    try:
        gdsckpt.save(state, tmp_path / "s.gdsckpt")
        saving, young_in_save = list(full), len(young)
        loaded = gdsckpt.load(tmp_path / "s.gdsckpt")
    finally:
        gc.callbacks.remove(count)
        gc.callbacks.remove(count_young)
    assert saving == [] and full == [], f"full collections: save {saving}, load {full[len(saving):]}"
    # the young generations were collected meanwhile: deferred full collections, not a collector off
    assert young_in_save > 0 and len(young) > young_in_save
    assert all(torch.equal(loaded[key], tensor) for key, tensor in state.items())


def test_a_restore_defers_by_its_index_length(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gdsckpt.format import TRAILER_SIZE, unpack_trailer
    from gdsckpt.pipeline import load as load_module

    path = tmp_path / "s.gdsckpt"
    gdsckpt.save({f"t{i}": torch.randn(2) for i in range(20_000)}, path)
    data = path.read_bytes()
    index_length = unpack_trailer(data[-TRAILER_SIZE:], len(data)).index_length
    before = gc.get_threshold()
    from gdsckpt.api import checkpoint as checkpoint_module
    seen = thresholds_seen_by(monkeypatch, "run_restore", load_module, checkpoint_module)
    gdsckpt.load(path)
    expected = index_length // collector.INDEX_BYTES_PER_OBJECT // (before[0] * before[1])
    assert expected > 10 and seen == [(before[0], before[1], before[2] + expected)], (seen, expected)


def test_a_deferral_stops_at_the_largest_threshold_the_collector_takes(tmp_path: Path) -> None:
    """A caller's oldest threshold near 2**31 (full collections made rare) made every save and
    load of thousands of tensors raise OverflowError from gc.set_threshold."""
    before = gc.get_threshold()
    try:
        gc.set_threshold(before[0], before[1], collector.THRESHOLD_MAX - 5)
        state = {f"t{i}": torch.randn(2) for i in range(2_000)}
        gdsckpt.save(state, tmp_path / "s.gdsckpt")
        assert torch.equal(gdsckpt.load(tmp_path / "s.gdsckpt")["t7"], state["t7"])
        assert gc.get_threshold() == (before[0], before[1], collector.THRESHOLD_MAX - 5)
    finally:
        gc.set_threshold(*before)


def test_a_threshold_set_that_raises_leaves_the_records_true(monkeypatch: pytest.MonkeyPatch) -> None:
    """The records were written before the set: one that raised while another thread's hold ran
    made the holds' own raised threshold look like the caller's, kept for good."""
    before = gc.get_threshold()
    original = gc.set_threshold
    refused: list[bool] = []

    def refusing_once(*args):  # type: ignore[no-untyped-def]
        if not refused:
            refused.append(True)
            raise OverflowError("refused")
        return original(*args)

    other = OtherThread(lambda: collector.young_only(700_000))
    other.start()
    try:
        monkeypatch.setattr(collector.gc, "set_threshold", refusing_once)
        with pytest.raises(OverflowError), collector.young_only(1_400_000):
            pass
    finally:
        other.end()
    assert refused and gc.get_threshold() == before


@pytest.mark.parametrize("after", ["sum", "get_threshold", "isenabled", "disable"])
def test_a_signal_handler_that_saves_inside_the_bookkeeping_leaves_it_consistent(
        after: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler runs in the thread it interrupts, after any builtin call returns: inside a step
    of the bookkeeping its own hold (or pause) worked on half-changed state (its end reset the
    records under the interrupted step: a TypeError out of the hold; with another thread
    holding, a threshold left raised). Simulated: the handler's hold or pause runs once when the
    builtin ``after`` returns inside the step, while another thread holds too."""
    before = gc.get_threshold()
    handled: list[bool] = []
    pause = after in ("isenabled", "disable")

    def hooked(original):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            result = original(*args)
            if not handled:
                handled.append(True)
                with collector.paused() if pause else collector.young_only(2_000_000):
                    pass
            return result
        return call

    other = OtherThread(lambda: collector.young_only(700_000))
    other.start()
    try:
        if after == "sum":  # the module's name for the builtin, as the step looks it up
            monkeypatch.setattr(collector, "sum", hooked(sum), raising=False)
        else:
            monkeypatch.setattr(collector.gc, after, hooked(getattr(gc, after)))
        other.end()  # its end runs the step with the handler (and the last end restores)
        with collector.paused() if pause else collector.young_only(1_400_000):
            pass
        monkeypatch.undo()
    finally:
        other.end()
    assert handled
    assert gc.get_threshold() == before and gc.isenabled()
    assert not collector._deferring and not collector._pausing
