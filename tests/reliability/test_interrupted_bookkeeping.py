"""A ^C at every line of the bookkeeping that saves share: the saves in flight
(``gdsckpt.api.inflight``), ``save_async``'s slots (``AsyncSaver``), and the lanes of the worker
pools, with the standard library's ``threading`` code they call.

A ^C's handler runs in the main thread at the next point where CPython checks for signals: a
Python function's start, or the return from a C function. This raises ``KeyboardInterrupt`` at
one such point of those files at a time (through a profile function), in the main thread only,
then checks that the process can still save: no lock is
left held (``threading.Condition.__exit__`` is Python code; a ^C there left the module-wide
lock of the saves in flight held, and every background save's end then blocked on it for
ever), no place or slot is left taken, and the interrupted call's file is either complete or
absent, the previous checkpoint never lost.
"""

from __future__ import annotations

import concurrent.futures._base
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

import gdsckpt
from gdsckpt.api import inflight
from gdsckpt.background import async_save
from gdsckpt.io import pools

WATCHED = tuple(os.path.realpath(path) for path in (threading.__file__, inflight.__file__,
                                                     async_save.__file__, pools.__file__))
"""The files whose signal points get a ^C: the shared bookkeeping and the threading code it calls."""

FUTURES = concurrent.futures._base.__file__

QUICK = gdsckpt.Config(timeout=5)
"""A leftover lock or place shows as a ``TimeoutError`` after 5 s, not the default 600."""


class _Interrupter:
    """A profile function that raises ``KeyboardInterrupt`` at the ``at``-th point of ``WATCHED``
    where CPython runs a pending signal's handler: a Python function's start, and the return
    from a C function called there (never, for ``at=None``: it counts them)."""

    def __init__(self, at: int | None) -> None:
        self.at = at
        self.points = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if (event in ("call", "c_return") and os.path.realpath(frame.f_code.co_filename) in WATCHED
                and not _inside_a_future(frame)):
            self.points += 1
            if self.points == self.at:
                sys.setprofile(None)
                raise KeyboardInterrupt


def _inside_a_future(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs for ``concurrent.futures.Future`` (its ``result`` waits through a
    ``threading.Condition``): left out, see docs/reliability.md."""
    while frame is not None:
        if frame.f_code.co_filename == FUTURES:
            return True
        frame = frame.f_back
    return False


def _run_interrupted(call: Callable[[], Any], at: int | None) -> tuple[int, bool]:
    """Run ``call`` under an interrupter; returns the points seen and whether it raised
    ``KeyboardInterrupt``."""
    interrupter = _Interrupter(at)
    sys.setprofile(interrupter)
    try:
        call()
    except KeyboardInterrupt:
        return interrupter.points, True
    finally:
        sys.setprofile(None)
    return interrupter.points, False


def _still_saves(tmp_path: Path, round_: int) -> None:
    """After an interrupted call: background saves end, blocking saves take their places, and
    nothing is left in flight."""
    gdsckpt.wait_all(10)
    later = {"w": torch.full((1000,), float(round_))}
    gdsckpt.save_async(later, tmp_path / "later.gdsckpt", config=QUICK).wait(10)
    gdsckpt.save(later, tmp_path / "later.gdsckpt", config=QUICK)
    gdsckpt.wait_all(10)
    assert torch.equal(gdsckpt.load(tmp_path / "later.gdsckpt")["w"], later["w"])
    assert async_save._default_saver.inflight == 0


def _one_of(path: Path, states: list[dict[str, torch.Tensor]]) -> None:
    loaded = gdsckpt.load(path)["w"]
    assert any(torch.equal(loaded, state["w"]) for state in states), "neither the old nor the new state"


@pytest.mark.parametrize("how", ["save_async", "save"])
def test_an_interrupt_at_any_point_of_the_shared_bookkeeping_leaves_saves_working(tmp_path: Path, how: str) -> None:
    path = tmp_path / "ckpt.gdsckpt"
    old = {"w": torch.arange(1000.0)}
    gdsckpt.save(old, path)

    def call(state: dict[str, torch.Tensor]) -> Callable[[], Any]:
        if how == "save":
            return lambda: gdsckpt.save(state, path, config=QUICK)
        return lambda: gdsckpt.save_async(state, path, config=QUICK)

    points, _ = _run_interrupted(call(old), None)
    gdsckpt.wait_all(10)
    assert points > 20  # the profiler sees the bookkeeping (a change of layout must not empty this test)
    interrupted = 0
    for at in range(1, points + 1):
        new = {"w": torch.arange(1000.0) + at}
        _, raised = _run_interrupted(call(new), at)
        interrupted += raised
        _still_saves(tmp_path, at)
        _one_of(path, [old, new])
        old = {"w": gdsckpt.load(path)["w"]}
    assert interrupted > points // 2
