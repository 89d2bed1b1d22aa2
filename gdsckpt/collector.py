"""Pausing Python's cyclic garbage collector while gdsckpt builds the objects of a state's index
and structure. A leaf module, as ``errors``: every layer may import it, it imports nothing of
the package.

Why: opening, saving or loading a state of many tensors allocates objects by the million (the
index's JSON document, a record per tensor, chunk and segment, the structure tree, a tensor
object per array), and nearly all of them outlive the phase that makes them. CPython's
collector runs on allocation counts, not on garbage: a full collection walks every object of
the process, the caller's model and optimizer state included, and the phases above set off
several per call for nothing to collect. With 100,000 small tensors that was about half of a
save's and of a load's time (docs/performance.md, "Many small tensors").

A pause covers such a phase only: CPU work whose length is bounded by the number of tensors and
chunks, never the reads or writes of a checkpoint's bytes. Reference counting frees everything
else as usual meanwhile; garbage with reference cycles that other threads make waits for the
pause to end. Pauses of several threads overlap: the collector runs again when the last one
ends, if it was running when the first began (a caller that disabled it before keeps it
disabled).

A whole save or restore, whose length does scale with its bytes, runs ``young_only``: the young
generations are collected as usual and full collections are deferred, by as many collections
of the middle generation as the call's own long-lived objects set off (``young_only(objects)``,
``expect``: 16 objects per array of a save's state, one per 16 bytes of a restore's index). The
objects the phases above leave alive otherwise set off full collections in the rest of the call, each
walking the whole process while they are all still alive: with 100,000 small tensors about a
fifth of a save's and of a load's time (docs/performance.md, "Many small tensors"); once the call
has returned and freed them, the next full collection walks a process of its usual size. The
deferral is bounded by allocations, not by time: garbage with cycles that reached the oldest
generation waits for at most about as many allocations as the call itself holds objects, by
whichever thread, so a save of a few large tensors defers nothing and a long save beside
training does not hold cyclic garbage for its whole length. Where ``gc.set_threshold`` ignores
the oldest generation's threshold (the incremental collector planned for Python 3.14), a hold
changes nothing.

An end interrupted by an exception a signal handler raises (^C) is finished before that
exception goes on: a thread's hold or pause left behind would outlast its call, and another
thread's end does not mend one whose thread still runs. A handler that saves while its thread is
inside a step of this bookkeeping runs without a pause or a deferral (``_bookkeeping``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Callable, Iterator

_lock = threading.RLock()
"""Guards the module's state (the pauses' below, the holds' further down). An ``RLock``: a signal
handler that saves while this thread is inside the bookkeeping takes it again instead of
waiting for itself."""
_pausing: set[int] = set()
"""Threads inside a pause. A set, not a count: adding and discarding are idempotent, so a ^C
that lands between the bookkeeping's steps leaves at worst this thread's entry, which the end
of its next pause removes."""
_disabled_here = False
"""Whether the collector is off because a pause turned it off (so the last pause's end turns it
on; set before ``gc.disable``, so that no interrupted step leaves it off unrecorded)."""


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Run the block with the cyclic garbage collector off (see the module docstring).

    A pause nested in another of its thread ends the outer one's early (the collector runs again
    for the rest of it: time, not correctness). A caller who turns the collector off while
    another thread's pause runs finds it on again when that pause ends: the setting is one for
    the process. An end a signal handler's exception (^C) interrupts is finished before the
    exception goes on (``_finish``); one that lands before the end begins leaves the collector
    off until this thread's next pause ends."""
    me = threading.get_ident()
    try:
        _begin(me)
        yield
    finally:
        _finish(_end, me)


_keeper: int | None = None
"""The thread inside the bookkeeping (``_bookkeeping``), under ``_lock``."""


@contextlib.contextmanager
def _bookkeeping() -> Iterator[bool]:
    """``_lock`` held for a step of the bookkeeping; yields False where the calling thread is
    inside a step already. A signal handler runs in the thread it interrupts, between any two
    builtin calls: a handler that saves there would work on state half changed (a hold's records
    reset under the interrupted step, a pause's flag set before the collector is off), so its
    steps do nothing: its call runs without a pause or a deferral (time, not correctness)."""
    global _keeper
    me = threading.get_ident()
    with _lock:
        if _keeper == me:
            yield False
            return
        _keeper = me
        try:
            yield True
        finally:
            _keeper = None


def _begin(me: int) -> None:
    global _disabled_here
    with _bookkeeping() as mine:
        if not mine:
            return
        if not _pausing and gc.isenabled():
            _disabled_here = True
            gc.disable()
        _pausing.add(me)


def _end(me: int) -> None:
    global _disabled_here
    with _bookkeeping() as mine:
        if not mine:
            return
        _pausing.discard(me)
        _drop_dead(_pausing)  # threads that ended without ending their pause
        if not _pausing and _disabled_here:
            gc.enable()  # before the flag: interrupted between the two, the next pause's end re-enables
            _disabled_here = False


OBJECTS_PER_ARRAY = 16
"""Long-lived objects a save makes per array, for its ``young_only`` budget: about twice the 7
counted at the end of a save of 100,000 small tensors (source, record, part, segment, ...)."""
INDEX_BYTES_PER_OBJECT = 16
"""Bytes of a restore's index per long-lived object it makes, for its budget (``expect``): the
parsed index of 100,000 small tensors held one object per 45 bytes of it, the restored state and
its targets as many again."""

THRESHOLD_MAX = 2**31 - 1
"""The largest threshold ``gc.set_threshold`` takes (a C int): a deferral stops there (a caller
who set the oldest threshold there defers full collections already)."""

_deferring: dict[int, int] = {}
"""Thread -> the objects its ``young_only`` hold expects to keep alive (its deferral budget)."""
_oldest_before: int | None = None
"""The oldest generation's threshold when the first hold began, restored when the last one ends
(recorded before it is changed, as ``_disabled_here``)."""
_oldest_set: int | None = None
"""The oldest generation's threshold the holds set last: one found otherwise is the caller's
(``gc.set_threshold`` while a hold ran), kept at the end and deferred from meanwhile."""


@contextlib.contextmanager
def young_only(objects: int = 0) -> Iterator[None]:
    """Run the block with full collections deferred by the collections of the middle generation
    that ``objects`` new long-lived objects set off (more with ``expect``), and the young
    generations collected as usual (see the module docstring). Holds of several threads add up;
    a nested one ends its thread's hold at its inner end (time, not correctness). The young and
    middle thresholds stay the caller's throughout, and an oldest one the caller sets meanwhile
    is kept."""
    me = threading.get_ident()
    try:
        with _bookkeeping() as mine:
            if mine:
                _deferring[me] = max(objects, 0)
                _apply_deferral()
        yield
    finally:
        _finish(_end_young_only, me)


def expect(objects: int) -> None:
    """Add ``objects`` to the budget of the calling thread's ``young_only`` hold (when the count
    is known only inside it: a restore learns it from the index's length); none: nothing."""
    me = threading.get_ident()
    with _bookkeeping() as mine:
        if mine and me in _deferring:
            _deferring[me] += max(objects, 0)
            _apply_deferral()


def _end_young_only(me: int) -> None:
    with _bookkeeping() as mine:
        if not mine:
            return
        _deferring.pop(me, None)
        _drop_dead(_deferring)  # threads that ended without ending their hold
        _apply_deferral()


def _apply_deferral() -> None:
    """Set the oldest generation's threshold for the holds now running (under ``_lock``)."""
    global _oldest_before, _oldest_set
    young, middle, oldest = gc.get_threshold()
    if _deferring:
        # the first hold's, or one the caller set meanwhile
        before = oldest if _oldest_before is None or oldest != _oldest_set else _oldest_before
        per_collection = young * middle
        extra = sum(_deferring.values()) // per_collection if per_collection > 0 else 0
        deferred = min(before + extra, THRESHOLD_MAX)
        gc.set_threshold(young, middle, deferred)
        # recorded once set: a set that raised leaves the records true to the collector
        _oldest_before, _oldest_set = before, deferred
    elif _oldest_before is not None:
        if oldest == _oldest_set:
            gc.set_threshold(young, middle, _oldest_before)  # before the records: see _finish
        _oldest_before = _oldest_set = None


def _finish(end: Callable[[int], None], me: int) -> None:
    """``end(me)``, done to its end even where a signal handler's exception (^C) interrupts it
    (each end is idempotent): a hold or pause it left would outlast this call, as long as the
    thread runs. The first such exception is raised after."""
    interrupted: BaseException | None = None
    for _attempt in range(100):
        try:
            end(me)
            break
        except BaseException as err:  # noqa: BLE001 - raised below, once the end is done
            interrupted = interrupted or err
    if interrupted is not None:
        raise interrupted


def _drop_dead(threads: set[int] | dict[int, int]) -> None:
    """Forget the threads of ``threads`` (pausing, or holding) that ended inside their pause or
    hold (under ``_lock``): ``threading`` knows every thread that ran Python code."""
    alive = {thread.ident for thread in threading.enumerate()}
    for ident in [ident for ident in threads if ident not in alive]:
        if isinstance(threads, dict):
            del threads[ident]
        else:
            threads.discard(ident)


def _forget_after_fork() -> None:
    """A child forked while another thread paused the collector (or deferred its full
    collections) has no such thread: the pause would never end there (nor would the lock it may
    have held be released)."""
    global _lock, _disabled_here
    _lock = threading.RLock()
    _pausing.clear()
    _deferring.clear()
    if _disabled_here:
        gc.enable()
        _disabled_here = False
    _apply_deferral()  # with no hold left: the oldest threshold as it was before the holds


os.register_at_fork(after_in_child=_forget_after_fork)
