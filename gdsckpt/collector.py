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
        for thread in list(_pausing):  # threads that ended without ending their pause
            if not _is_alive(thread):
                _pausing.discard(thread)
        if not _pausing and _disabled_here:
            gc.enable()  # before the flag: interrupted between the two, the next pause's end re-enables
            _disabled_here = False


def _is_alive(ident: int) -> bool:
    """Whether the thread ``ident`` still runs (``threading`` knows every thread that ran
    Python code)."""
    return any(thread.ident == ident for thread in threading.enumerate())


def _forget_after_fork() -> None:
    """A child forked while another thread paused the collector has no such thread: the pause
    would never end there (nor would the lock it may have held be released)."""
    global _lock, _disabled_here
    _lock = threading.RLock()
    _pausing.clear()
    if _disabled_here:
        gc.enable()
        _disabled_here = False


os.register_at_fork(after_in_child=_forget_after_fork)
