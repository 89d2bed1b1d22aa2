"""Spawn ranks and wait for them with a deadline (shared by benchmarks/dcp_bench.py and
tests/gpu/test_dcp_nccl.py).

``torch.multiprocessing.start_processes(join=True)`` waits forever on a rank stuck in a
collective; this waits at most ``seconds``, then terminates (and if need be kills) every rank
still alive. Ranks are spawned, never forked, so a parent that initialised CUDA is safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def spawn_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, seconds: float) -> str | None:
    """Run ``fn(rank, *args)`` on ``nprocs`` spawned processes. Returns None when every one exited
    0, else how the group ended (a rank raised or died, or the deadline passed)."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + seconds
    ending: str | None = None
    try:
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                ending = f"still running after {seconds} s: terminated"
                break
    except ProcessException as err:  # a rank raised or died; torch ends the others
        ending = f"{type(err).__name__}: {err}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
                    process.join(timeout=10)
    return ending
