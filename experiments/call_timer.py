"""Wall time spent inside chosen calls, summed over calls and threads, for the profiling
experiments (``lossy_save_profile.py``, ``delta_depth_profile.py``). cProfile sees one thread; the
GPU engine's work runs in its worker, so those scripts wrap the calls they care about instead."""

from __future__ import annotations

import time
from typing import Any

spent: dict[str, list[float]] = {}
"""``"Owner.name"`` -> [seconds, calls] since the last ``spent.clear()``."""


def timed(owner: Any, name: str) -> None:
    """Wrap ``owner.name`` (a class or module attribute) to add each call's wall time to ``spent``."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            entry = spent.setdefault(f"{getattr(owner, '__name__', owner)}.{name}", [0.0, 0])
            entry[0] += time.perf_counter() - started
            entry[1] += 1

    setattr(owner, name, wrapper)


def print_spent(indent: str = "   ") -> None:
    """Print ``spent``, the largest first."""
    for label, (seconds, calls) in sorted(spent.items(), key=lambda item: -item[1][0]):
        print(f"{indent}{label:40} {seconds:8.3f} s {calls:6d} calls")
