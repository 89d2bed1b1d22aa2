"""Durable writes of chunks stored as they are, each way a save could write them.

Writes a state of 16 float32 tensors with ``gdsckpt.save(codec="none")`` one way after the
other, round-robin in one process, and ``safetensors.torch.save_file`` + fsync beside them:

- ``views+writeback``: the default; chunks go to the writer from the tensors' memory, written
  buffered with their write-back started at once (``io.posix.start_write_back``);
- ``views+wait``: the same, also waiting for each write-back (``sync_file_range`` with
  WAIT_BEFORE | WRITE | WAIT_AFTER), so a write's completion would show the storage;
- ``views, no write-back``: buffered, every dirty page left to the final fsync;
- ``copies+O_DIRECT``: ``Config(o_direct=True)``: each chunk copied into an aligned buffer and
  written with O_DIRECT (what every save did before).

Usage: ``python3 experiments/write_ways.py --size-mib 64 --rounds 15 --dir /path/on/the/disk``.
Prints medians, minima and maxima in ms. Uses internals: ``io.posix._SYNC_FILE_RANGE_WRITE``
(patched to switch the wait on and off).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

import gdsckpt
from gdsckpt.io import posix

WAYS = {
    "views+writeback": ({}, 2),
    "views+wait": ({}, 1 | 2 | 4),
    "views, no write-back": ({}, 0),
    "copies+O_DIRECT": ({"o_direct": True}, 2),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dir", default=None, help="a directory on the storage to measure (default: a temporary one)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    size = args.size_mib << 20
    state = {f"w{i}": torch.randn(size // 4 // 16) for i in range(16)}
    times: dict[str, list[float]] = {name: [] for name in [*WAYS, "safetensors"]}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for _ in range(args.rounds):
            for name in times:
                path = Path(directory) / f"{name.replace(' ', '_').replace(',', '')}.gdsckpt"
                started = time.perf_counter()
                if name == "safetensors":
                    save_file(state, str(path))
                    fd = os.open(path, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
                else:
                    fields, flags = WAYS[name]
                    posix._SYNC_FILE_RANGE_WRITE = flags  # 0: sync_file_range does nothing
                    gdsckpt.save(state, path, codec="none", config=gdsckpt.Config(**fields))
                times[name].append(time.perf_counter() - started)
                path.unlink()
    posix._SYNC_FILE_RANGE_WRITE = 2
    print(f"{args.size_mib} MiB, {args.rounds} rounds, io_threads={gdsckpt.Config().io_threads}")
    for name, values in times.items():
        values.sort()
        print(f"  {name:22s} median {statistics.median(values) * 1e3:7.1f} ms  min {values[0] * 1e3:7.1f}"
              f"  max {values[-1] * 1e3:7.1f}")


if __name__ == "__main__":
    main()
