"""``codec="auto"`` on the CPU engine, save by save: compress adaptively, or store as it is.

Within a save the adaptive engine (``engine.HostEngine(adaptive=True)``) decides chunk by chunk
from the writer's queue and its codec's measured speed, assuming that the codec threads and the
writes run side by side. Where the cores compress more slowly than the storage writes they do
not: the writes need the CPU too (submitting, completing, copying), and with every core
compressing they slow down, so a save that compressed whatever its queue allowed still ended
later than one that compressed nothing (docs/performance.md, "Save and load on the CPU").

So before a save of host state of at least ``MEASURED_MIN_BYTES`` to a local file, ``auto`` asks
one question: can the codec threads keep up with the storage? It compares the codec's speed,
``threads x one thread's measured pace x CPU_PARALLEL_EFFICIENCY`` (the pace is what the engine
measured on the chunks it compressed in the last compressed saves to the same storage, a moving
average), with the storage's durable write speed (``autotune.storage_gbps``: one probe per
filesystem, cached on disk, or ``Config.storage_gbps``). Slower: every chunk is stored as it is
(``none/1``), since compressing would only slow the save. As fast or faster: the adaptive engine
compresses. Before anything is measured the save compresses (that measures the pace), and every
``EXPLORE_EVERY``-th save that would be stored as it is compresses instead, so the pace follows a
state that starts to compress differently.

The pace is remembered per storage (the filesystem's device number) and number of codec threads,
in the process and in the measurement cache beside the storage probe's
(``autotune.update_cache``), so the first save of a later process on the same machine need not
compress to find it out. Smaller saves, objects (``s3://``), deltas (always compressed,
``engine`` module docstring), background saves (their speed says more about the training beside
them) and the saves of a ``CheckpointManager`` with a remote tier (the file is uploaded too,
where every byte saved is worth ``ratio`` bytes of state) keep the adaptive engine and are not
measured.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .autotune import CPU_PARALLEL_EFFICIENCY, read_cache, update_cache

EXPLORE_EVERY = 8
"""Every this many measured saves stored as they are, one is compressed to measure the pace again."""
MEASURED_MIN_BYTES = 16 << 20
"""Logical bytes from which a save asks the question (smaller saves are fixed costs)."""
MOVING_WEIGHT = 0.5
"""Weight of the newest save in the moving average of the codec's pace."""


@dataclass
class StorageOutcomes:
    """What this process's ``codec="auto"`` saves to one storage measured."""

    gbps_per_thread: float | None = None
    """One codec thread's pace (GB/s of raw bytes; moving average over compressed saves)."""
    saves: int = 0
    """Measured saves so far, either way."""


@dataclass(frozen=True)
class HostAutoChoice:
    """A save's way (``as_is``), the reason in words, and the figures it was chosen by."""

    as_is: bool
    reason: str
    codec_gbps: float | None = None
    """Predicted speed of the codec threads (GB/s of state), where a pace was known."""
    storage_gbps: float | None = None


def storage_key(path: Any) -> tuple[str, Path] | None:
    """(``dev:<number>``, directory) of a local file path's directory; None for anything else (an
    ``s3://`` object, a storage writer, a file object, a directory that does not exist)."""
    if not isinstance(path, (str, os.PathLike)) or str(path).startswith("s3://"):
        return None
    directory = Path(path).expanduser().parent
    try:
        return f"dev:{os.stat(directory).st_dev}", directory
    except OSError:
        return None


class HostAutoHistory:
    """The codec pace of this process's ``codec="auto"`` saves on the CPU engine, per storage, and
    the choice it leads to (module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outcomes: dict[str, StorageOutcomes] = {}

    def choose(self, key: str, logical_bytes: int, threads: int,
               storage_gbps: Callable[[], float | None]) -> HostAutoChoice:
        """Whether a save of ``logical_bytes`` to storage ``key`` on ``threads`` codec threads
        stores its chunks as they are; ``storage_gbps()`` (called only when needed) gives the
        storage's write speed, None where it could not be measured (then: compressed)."""
        if logical_bytes < MEASURED_MIN_BYTES:
            return HostAutoChoice(False, f"compressed: a save under {MEASURED_MIN_BYTES >> 20} MiB is not weighed")
        with self._lock:
            known = self._outcomes.get(key)
            pace = known.gbps_per_thread if known is not None else None
            saves = known.saves if known is not None else 0
        if pace is None:
            pace = cached_pace(key, threads)
            if pace is not None:  # measured by an earlier process: this one starts from it
                with self._lock:
                    self._outcomes.setdefault(key, StorageOutcomes()).gbps_per_thread = pace
                saves = 1
        if pace is None:
            return HostAutoChoice(False, "compressed: the codec's pace on this state is not measured yet")
        codec = threads * pace * CPU_PARALLEL_EFFICIENCY
        storage = storage_gbps()
        if storage is None:
            return HostAutoChoice(False, "compressed: the storage's write speed could not be measured (too little "
                                  "free space for its probe, or the probe's write failed)", codec)
        if codec >= storage:
            return HostAutoChoice(False, f"compressed: the codec threads ({codec:.2f} GB/s) keep up with the "
                                  f"storage ({storage:.2f} GB/s)", codec, storage)
        if saves % EXPLORE_EVERY == 0:
            return HostAutoChoice(False, f"compressed, once: the codec's pace is measured again every "
                                  f"{EXPLORE_EVERY} saves", codec, storage)
        return HostAutoChoice(True, f"as it is: the codec threads ({codec:.2f} GB/s) would hold back the "
                              f"storage ({storage:.2f} GB/s)", codec, storage)

    def record(self, key: str, logical_bytes: int, gbps_per_thread: float | None, threads: int = 0) -> None:
        """Count one finished save of ``logical_bytes`` (saves under ``MEASURED_MIN_BYTES`` are not
        counted) and fold the pace its engine measured on ``threads`` codec threads, if it
        compressed anything, into the storage's moving average (and the cache, with ``threads``)."""
        if logical_bytes < MEASURED_MIN_BYTES:
            return
        with self._lock:
            known = self._outcomes.setdefault(key, StorageOutcomes())
            known.saves += 1
            if gbps_per_thread is None or gbps_per_thread <= 0:
                return
            old = known.gbps_per_thread
            known.gbps_per_thread = pace = (gbps_per_thread if old is None
                                            else old + MOVING_WEIGHT * (gbps_per_thread - old))
        if threads:
            update_cache(_cache_key(key, threads), {"gbps_per_thread": pace})

    def outcomes(self, key: str) -> StorageOutcomes | None:
        """A copy of what is known of storage ``key``."""
        with self._lock:
            known = self._outcomes.get(key)
            return None if known is None else StorageOutcomes(**vars(known))

    def clear(self) -> None:
        """Forget every storage (tests; a process whose state changed character)."""
        with self._lock:
            self._outcomes.clear()


def _cache_key(key: str, threads: int) -> str:
    return f"zstd pace:{key}:{threads} threads"


def cached_pace(key: str, threads: int) -> float | None:
    """The pace an earlier process measured for storage ``key`` on ``threads`` codec threads."""
    entry = read_cache().get(_cache_key(key, threads))
    pace = entry.get("gbps_per_thread") if isinstance(entry, dict) else None
    return float(pace) if isinstance(pace, (int, float)) and pace > 0 else None


HISTORY = HostAutoHistory()
"""The process's memory of its ``codec="auto"`` saves on the CPU engine."""


def _free_lock_after_fork() -> None:
    """A forked child keeps what its parent learned, with the lock free (a thread of the parent
    holding it at the fork would never release it in the child)."""
    HISTORY._lock = threading.Lock()


os.register_at_fork(after_in_child=_free_lock_after_fork)
