"""``codec="auto"`` on the CPU engine, save by save: compress adaptively, or store as it is.

Within a save the adaptive engine (``engine.HostEngine(adaptive=True)``) decides chunk by chunk
from the writer's queue and its codec's measured speed, assuming the codec threads and the writes
run side by side. On a host with few cores they do not: the writes themselves need the CPU
(submitting, completing, copying), and with every core compressing they slow down, so a save that
compressed as much as its queue allowed can still end later than one that compressed nothing
(docs/performance.md, "Save and load on the CPU"). No chunk-level prediction sees that; the
outcome of whole saves does.

So ``codec="auto"`` on host state also remembers, per storage (the filesystem's device number,
or the object store's bucket), how fast its saves ran, as a moving average of logical bytes per
second for each of two ways: compressed (the adaptive engine) and as it is (every chunk stored
uncompressed, ``none/1``). The first save compresses. Once a compressed save shows the storage
waiting for the codec threads (a chunk stored as it is), the next save stores everything as it
is, and from then on each save takes the faster way, trying the other every ``EXPLORE_EVERY``-th
save so a change in the storage or the state is noticed. Where the storage never waits the codec
threads keep up and nothing else is tried. The memory is per process, as the cores and the
storage are.

Only saves of at least ``MEASURED_MIN_BYTES`` are measured (smaller ones are fixed costs:
opening, fsyncs, the rename); smaller saves follow what the larger ones found. Deltas are always
compressed (``engine`` module docstring) and are not measured; neither are background saves,
whose speed says more about the training beside them than about the storage.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..io.s3 import SCHEME, is_url

EXPLORE_EVERY = 8
"""Every this many measured saves to a storage, the way that ran slower is tried once more."""
MEASURED_MIN_BYTES = 16 << 20
"""Logical bytes a save needs for its speed to count."""
MOVING_WEIGHT = 0.5
"""Weight of the newest save in each way's moving average of speed."""


@dataclass
class StorageOutcomes:
    """What the measured ``codec="auto"`` saves to one storage found (speeds in GB/s of state)."""

    compressed_gbps: float | None = None
    as_is_gbps: float | None = None
    saves: int = 0
    """Saves measured so far (both ways)."""
    storage_waited: bool = False
    """Whether a compressed save stored a chunk as it is because the writer was waiting."""


@dataclass(frozen=True)
class HostAutoChoice:
    """A save's way (``as_is``), the reason in words, and the speeds it was chosen by."""

    as_is: bool
    reason: str
    compressed_gbps: float | None
    as_is_gbps: float | None
    explore: bool = False


def storage_key(path: Any) -> str | None:
    """The storage a save's ``path`` writes to: ``dev:<number>`` of a local path's directory,
    ``url:<scheme>://<bucket>`` of an object; None for anything else (a storage writer object,
    a file object), which is never remembered."""
    if is_url(path):
        return f"url:{SCHEME}{path[len(SCHEME):].partition('/')[0]}"
    if not isinstance(path, (str, os.PathLike)):
        return None
    directory = Path(path).expanduser().parent
    try:
        return f"dev:{os.stat(directory).st_dev}"
    except OSError:
        return None


class HostAutoHistory:
    """The per-storage outcomes of this process's ``codec="auto"`` saves on the CPU engine and
    the choice they lead to (module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outcomes: dict[str, StorageOutcomes] = {}

    def choose(self, key: str | None, logical_bytes: int) -> HostAutoChoice:
        """Whether a save of ``logical_bytes`` to storage ``key`` stores its chunks as they are."""
        with self._lock:
            known = self._outcomes.get(key) if key is not None else None
            if known is None or known.compressed_gbps is None:
                return HostAutoChoice(False, "compressed: no earlier save to this storage was measured", None, None)
            compressed, as_is = known.compressed_gbps, known.as_is_gbps
            measured = logical_bytes >= MEASURED_MIN_BYTES
            if as_is is None:
                if known.storage_waited and measured:
                    return HostAutoChoice(True, "as it is, once: the last compressed save left the storage "
                                          "waiting for the codec threads", compressed, None, explore=True)
                return HostAutoChoice(False, "compressed: the codec threads kept up with the storage",
                                      compressed, None)
            faster_as_is = as_is > compressed
            explore = measured and known.saves % EXPLORE_EVERY == 0
            as_is_now = faster_as_is != explore
            if explore:
                reason = (f"{'as it is' if as_is_now else 'compressed'}, once: the slower way is tried again "
                          f"every {EXPLORE_EVERY} saves")
            elif as_is_now:
                reason = "as it is: earlier saves to this storage ran faster uncompressed"
            else:
                reason = "compressed: earlier saves to this storage ran faster compressed"
            return HostAutoChoice(as_is_now, reason, compressed, as_is, explore=explore)

    def record(self, key: str | None, *, as_is: bool, logical_bytes: int, seconds: float,
               stored_as_is: int) -> None:
        """Fold one finished save into the storage's outcomes (saves below
        ``MEASURED_MIN_BYTES`` and unkeyed storage are not recorded)."""
        if key is None or logical_bytes < MEASURED_MIN_BYTES or seconds <= 0:
            return
        speed = logical_bytes / seconds / 1e9
        with self._lock:
            known = self._outcomes.setdefault(key, StorageOutcomes())
            known.saves += 1
            if as_is:
                known.as_is_gbps = _moved(known.as_is_gbps, speed)
            else:
                known.compressed_gbps = _moved(known.compressed_gbps, speed)
                known.storage_waited = known.storage_waited or stored_as_is > 0

    def outcomes(self, key: str) -> StorageOutcomes | None:
        """A copy of what is known of storage ``key``."""
        with self._lock:
            known = self._outcomes.get(key)
            return None if known is None else StorageOutcomes(**vars(known))

    def clear(self) -> None:
        """Forget every storage (tests; a process whose storage changed under the same device)."""
        with self._lock:
            self._outcomes.clear()


def _moved(average: float | None, value: float) -> float:
    return value if average is None else average + MOVING_WEIGHT * (value - average)


HISTORY = HostAutoHistory()
"""The process's memory of its ``codec="auto"`` saves on the CPU engine."""
