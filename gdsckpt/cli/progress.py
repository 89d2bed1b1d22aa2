"""Progress bars for the command line: bytes done, rate and ETA through tqdm, drawn only when
stderr is a terminal and ``--quiet`` is not given (so logs and pipes stay clean)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any


class Advance:
    """``advance(n)`` moves the bar on by ``n`` units; ``set_total(total)`` changes its length.
    Both do nothing when no bar is shown."""

    def __init__(self, bar: Any = None):
        self.bar = bar

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def set_total(self, total: int) -> None:
        """Change the bar's total (a size known only once the work has started) and redraw it;
        nothing without a bar."""
        if self.bar is not None and self.bar.total != total:
            self.bar.total = total
            self.bar.refresh()


@contextlib.contextmanager
def progress_bar(total: int | None, description: str, *, quiet: bool = False,
                 unit: str = "B") -> Iterator[Advance]:
    """Yield an ``Advance`` for a bar of ``total`` units (bytes by default; None: unknown yet).

    Without a terminal on stderr, with ``quiet``, or without tqdm installed, nothing is drawn:
    callers never need to know whether a bar is shown.
    """
    if quiet or not sys.stderr.isatty():
        yield Advance()
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield Advance()
        return
    with tqdm(total=total, desc=description, unit=unit, unit_scale=True,
              unit_divisor=1024 if unit == "B" else 1000, file=sys.stderr, dynamic_ncols=True,
              leave=False) as bar:
        yield Advance(bar)


def byte_progress(advance: Advance) -> Callable[[int, int], None]:
    """Adapt an ``Advance`` to the library's ``progress(done, total)`` callback."""
    seen = [0]

    def progress(done: int, total: int) -> None:
        advance.set_total(total)
        advance(done - seen[0])
        seen[0] = done
    return progress
