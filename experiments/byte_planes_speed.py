"""Speed of the CPU byte-plane transform: the word-wise ``planes_forward`` / ``planes_inverse``
of ``gdsckpt.codecs.cpu`` against their strided-copy definitions, and the forward transform's
block size (``PLANES_BLOCK_BYTES``) against smaller blocks and a whole chunk at once.

Each case transforms one chunk of random bytes (``--chunk``, 4 MiB as the CPU engine's default
``chunk_bytes``) ``--calls`` times per round; prints GB/s of input, the best of ``--rounds``
rounds, per element width. Uses internals: it sets ``PLANES_BLOCK_BYTES`` for the block cases.

    python3 experiments/byte_planes_speed.py --rounds 5 --calls 10
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from gdsckpt.codecs import cpu


def best_gbps(function: Callable[[], Any], nbytes: int, rounds: int, calls: int) -> float:
    """GB/s of ``nbytes`` per call, from the fastest of ``rounds`` rounds of ``calls`` calls."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            function()
        best = min(best, (time.perf_counter() - start) / calls)
    return nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk", type=int, default=4 << 20, help="bytes per chunk (default 4 MiB)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    data = np.random.default_rng(0).integers(0, 256, args.chunk, dtype=np.uint8)
    print(f"numpy {np.__version__}, {os.cpu_count()} cores, {platform.machine()}, chunk {args.chunk} bytes, "
          f"best of {args.rounds} x {args.calls}; GB/s of input")
    default_block = cpu.PLANES_BLOCK_BYTES
    for width in (2, 4, 8):
        planes = cpu.planes_forward(data, width)
        row = {
            "forward, strided copy": best_gbps(partial(cpu.planes_forward_reference, data, width), data.size,
                                               args.rounds, args.calls),
            "inverse, strided copy": best_gbps(partial(cpu.planes_inverse_reference, planes, width), data.size,
                                               args.rounds, args.calls),
            "inverse, word-wise": best_gbps(partial(cpu.planes_inverse, planes, width), data.size,
                                            args.rounds, args.calls),
        }
        for block in (256 << 10, default_block, args.chunk):
            cpu.PLANES_BLOCK_BYTES = block
            row[f"forward, word-wise, {block >> 10} KiB blocks"] = best_gbps(
                partial(cpu.planes_forward, data, width), data.size, args.rounds, args.calls)
        cpu.PLANES_BLOCK_BYTES = default_block
        for name, gbps in row.items():
            print(f"width {width}  {name:40s} {gbps:7.2f}")


if __name__ == "__main__":
    main()
