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
pause to end. Pauses nest and overlap across threads: the collector runs again when the last
one ends, if it was running when the first began (a caller that disabled it keeps it disabled).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
"""Pauses in progress, in every thread."""
_disabled_here = False
"""Whether the collector is off because a pause turned it off (so a pause's end turns it on)."""


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Run the block with the cyclic garbage collector off (see the module docstring).

    A ^C that lands inside the end of a pause, before ``gc.enable``, leaves the collector off
    only until the next pause ends (``_disabled_here`` stays set)."""
    _begin()
    try:
        yield
    finally:
        _end()


def _begin() -> None:
    global _depth, _disabled_here
    with _lock:
        if _depth == 0 and gc.isenabled():
            gc.disable()
            _disabled_here = True
        _depth += 1


def _end() -> None:
    global _depth, _disabled_here
    with _lock:
        _depth = max(0, _depth - 1)  # 0 already in a child forked during another thread's pause
        if _depth == 0 and _disabled_here:
            gc.enable()  # before the flag: interrupted between the two, the next pause's end re-enables
            _disabled_here = False


def _forget_after_fork() -> None:
    """A child forked while another thread paused the collector has no such thread: the pause
    would never end there (nor would the lock it may have held be released)."""
    global _lock, _depth, _disabled_here
    _lock = threading.Lock()
    _depth = 0
    if _disabled_here:
        gc.enable()
        _disabled_here = False


os.register_at_fork(after_in_child=_forget_after_fork)
