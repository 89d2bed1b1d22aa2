"""``gdsckpt.collector.paused``: the cyclic garbage collector is off while gdsckpt builds the
objects of an index or a structure (the full collections it set off walked the whole heap, the
caller's state included, for nothing: about half of a 100,000-tensor save or load), and exactly
as the caller had it afterwards, whatever happens in between."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import gdsckpt
from gdsckpt import collector
from gdsckpt.format import index as index_module
from gdsckpt.state import tree as tree_module


@pytest.fixture(autouse=True)
def collector_enabled() -> Iterator[None]:
    """Each test starts with the collector on, and leaves it on."""
    assert gc.isenabled()
    yield
    gc.enable()


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


def test_overlapping_pauses_of_two_threads_end_with_the_last() -> None:
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with collector.paused():
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=other)
    with collector.paused():
        thread.start()
        assert inside.wait(30)
    assert not gc.isenabled()  # the other thread's pause goes on
    release.set()
    thread.join(30)
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
