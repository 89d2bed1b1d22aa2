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
generations are collected as usual (garbage with cycles made meanwhile, by any thread, is
freed as before), only the full collections wait for its end. The objects the phases above
leave alive (several per tensor) otherwise set off full collections in the rest of the call,
each walking the whole process while they are all still alive: with 100,000 small tensors
about a fifth of a save's and of a load's time (docs/performance.md, "Many small tensors"). Once
the call has returned and they are freed, the next full collection walks a process its size
again. On Python 3.14's incremental collector, which has no full collections to defer, it
changes nothing.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

_lock = threading.RLock()
"""Guards the two below. An ``RLock``: a signal handler that saves while this thread is inside
``_begin`` or ``_end`` takes it again instead of waiting for itself."""
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
    the process. A ^C that lands inside a pause's own bookkeeping leaves the collector off at
    worst until the next pause of gdsckpt ends."""
    me = threading.get_ident()
    try:
        _begin(me)
        yield
    finally:
        _end(me)


def _begin(me: int) -> None:
    global _disabled_here
    with _lock:
        if not _pausing and gc.isenabled():
            _disabled_here = True
            gc.disable()
        _pausing.add(me)


def _end(me: int) -> None:
    global _disabled_here
    with _lock:
        _pausing.discard(me)
        _drop_dead(_pausing)  # threads that ended without ending their pause
        if not _pausing and _disabled_here:
            gc.enable()  # before the flag: interrupted between the two, the next pause's end re-enables
            _disabled_here = False


_young_only: set[int] = set()
"""Threads inside ``young_only`` (a set for the reasons of ``_pausing``)."""
_thresholds_before: tuple[int, int, int] | None = None
"""The collector's thresholds when the first ``young_only`` began, restored when the last one
ends (recorded before they are changed, as ``_disabled_here``)."""
FULL_COLLECTIONS_DEFERRED = 1 << 30
"""The oldest generation's threshold inside ``young_only``: full collections run after that many
collections of the middle one, never within one save or restore."""


@contextlib.contextmanager
def young_only() -> Iterator[None]:
    """Run the block with the collector's full collections deferred and the young generations
    collected as usual (see the module docstring). Holds of several threads overlap, as pauses
    do; a nested one ends its thread's hold at its inner end. Thresholds a caller sets while a
    hold runs are theirs: the end leaves them. A ^C inside the bookkeeping is mended by the next
    hold's end, as for ``paused``."""
    me = threading.get_ident()
    try:
        _begin_young_only(me)
        yield
    finally:
        _end_young_only(me)


def _begin_young_only(me: int) -> None:
    global _thresholds_before
    with _lock:
        if not _young_only and _thresholds_before is None:
            young, middle, oldest = gc.get_threshold()
            _thresholds_before = (young, middle, oldest)
            gc.set_threshold(young, middle, FULL_COLLECTIONS_DEFERRED)
        _young_only.add(me)


def _end_young_only(me: int) -> None:
    global _thresholds_before
    with _lock:
        _young_only.discard(me)
        _drop_dead(_young_only)
        before = _thresholds_before
        if not _young_only and before is not None:
            if gc.get_threshold() == (before[0], before[1], FULL_COLLECTIONS_DEFERRED):
                gc.set_threshold(*before)  # before the record: interrupted between, the next end mends it
            _thresholds_before = None


def _drop_dead(threads: set[int]) -> None:
    """Forget the threads of ``threads`` that ended inside their hold (under ``_lock``)."""
    for thread in list(threads):
        if not _is_alive(thread):
            threads.discard(thread)


def _is_alive(ident: int) -> bool:
    """Whether the thread ``ident`` still runs (``threading`` knows every thread that ran
    Python code)."""
    return any(thread.ident == ident for thread in threading.enumerate())


def _forget_after_fork() -> None:
    """A child forked while another thread paused the collector (or deferred its full
    collections) has no such thread: the pause would never end there (nor would the lock it may
    have held be released)."""
    global _lock, _disabled_here, _thresholds_before
    _lock = threading.RLock()
    _pausing.clear()
    _young_only.clear()
    if _disabled_here:
        gc.enable()
        _disabled_here = False
    if _thresholds_before is not None:
        if gc.get_threshold()[2] == FULL_COLLECTIONS_DEFERRED:
            gc.set_threshold(*_thresholds_before)
        _thresholds_before = None


os.register_at_fork(after_in_child=_forget_after_fork)
