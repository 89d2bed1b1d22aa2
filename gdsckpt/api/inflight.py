"""The saves in flight in this process, so that saves sharing a file run one after another.

A save writes one file and a delta save also reads another as its base; ``rebase`` and
``convert`` read one checkpoint and write another. Two of these that share a file must not
overlap, whichever API started them:

- two saves to one file: the older could finish last and replace the newer;
- a save over a file that a delta save in flight reads as its base: the delta is written against
  bytes that are then replaced, and never loads (``DeltaBaseError``) although both calls
  reported success;
- a delta save, or a conversion, reading a file that a save in flight is about to replace.

Each such operation takes a place here (``exclusive``, or ``board`` and ``land`` for a
background save, whose place lasts until its thread ends) and first waits, at most its
configuration's ``timeout``, until no operation in flight shares a file with it. A synchronous
``save`` thus waits for a ``save_async`` to the same file, or to its base, started before it.
A place is keyed by the file's real path (an ``s3://`` URL as it is), so two names of one file
are one key. The operation's own thread never waits for itself: a background save's callbacks
may save a file it holds.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from ..io.pools import Gate
from ..io.s3 import is_url

__all__ = ["Flight", "board", "exclusive", "land", "location_key"]


def location_key(location: Any) -> str | None:
    """What names the file or object an operation writes or reads: its real path, or the URL;
    None for a writer or file object (nothing else can name it)."""
    if location is None or not isinstance(location, (str, os.PathLike)):
        return None
    if is_url(location):
        return str(location)
    return os.path.realpath(os.fspath(location))


class Flight:
    """One operation's place: the file it writes (``key``), the one it reads as a base or
    source (``base_key``) and the thread running it (``owner``; None until a background save's
    thread starts)."""

    def __init__(self, key: str | None, base_key: str | None, owner: int | None) -> None:
        self.key = key
        self.base_key = base_key
        self.owner = owner

    def shares_a_file_with(self, other: Flight) -> bool:
        """Whether the two write the same file, or one writes what the other reads."""
        return any(a is not None and a == b for a, b in ((self.key, other.key), (self.key, other.base_key),
                                                         (self.base_key, other.key)))


_gate = Gate(what="the bookkeeping of the saves and loads in flight")
"""Guards ``_flying``; a ^C while a save takes or gives back its place leaves it usable."""
_flying: list[Flight] = []


def bookkeeping_lock() -> Any:
    """The lock of the bookkeeping above (an ``RLock``): a background save's end takes it, so a
    thread that holds it must not wait for one (``async_save``)."""
    return _gate.lock


def _forget_after_fork() -> None:
    """A forked child has none of its parent's threads: the operations they ran are not in flight
    there (a lock held by one of them at the fork would never be released)."""
    global _gate
    _gate = Gate(what="the bookkeeping of the saves and loads in flight")
    _flying.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _blocking(flight: Flight) -> list[Flight]:
    me = threading.get_ident()
    return [other for other in _flying if other.owner != me and other.shares_a_file_with(flight)]


def board(path: Any, base: Any, timeout: float, *, owner: int | None = None, what: str = "save") -> tuple[Flight, bool]:
    """Take a place for an operation writing ``path`` and reading ``base`` (either may be None),
    once no operation in flight shares a file with it; returns the place and whether it waited.
    ``TimeoutError`` after ``timeout`` seconds. ``owner``: the thread that runs it (default: the
    calling thread)."""
    flight = Flight(location_key(path), location_key(base), threading.get_ident() if owner is None else owner)
    if flight.key is None and flight.base_key is None:
        return flight, False
    checks = 0

    def free() -> bool:  # called under the gate's lock: a second call means it waited
        nonlocal checks
        checks += 1
        return not _blocking(flight)

    try:
        boarded = _gate.wait_for(free, timeout, then=lambda: _flying.append(flight))
    except BaseException:
        land(flight)  # a ^C right after it took its place
        raise
    if not boarded:
        raise TimeoutError(f"{what} of {str(path)!r}: another operation on that file"
                           f"{' or its base' if base is not None else ''} still in flight after "
                           f"{timeout} s (config timeout)")
    return flight, checks > 1


def land(flight: Flight) -> None:
    """Give the place back (safe more than once)."""
    with _gate.lock:
        if flight in _flying:
            _flying.remove(flight)
            _gate.notify_all()


@contextlib.contextmanager
def exclusive(path: Any, base: Any, timeout: float, *, what: str = "save") -> Iterator[bool]:
    """``board`` for the block (the calling thread runs it), ``land`` after it; yields whether
    it waited for another operation first."""
    flight, waited = board(path, base, timeout, what=what)
    try:
        yield waited
    finally:
        land(flight)
