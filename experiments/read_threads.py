"""Cold loads on the CPU engine read through the page cache by one thread against two, next to
torch.load of the same state, at several sizes: where a second reader thread starts to pay
(``io.posix.ONE_READER_BYTES``).

For each ``--sizes`` entry the benchmarks' trained state (``benchlib.build_state``, one training
step) is saved with ``codec="none"`` (the reads, not the decoding, are measured) and with
``torch.save``; then, ``--rounds`` times round robin, each file is pushed out of the page cache
(``benchlib.make_cold``) and loaded: ``gdsckpt.load`` from a ``PosixReader`` with one and with two
threads, and ``torch.load(weights_only=True)``. Prints the median, first quartile and fastest load
in ms. Uses internals: it gives each reader a lane of the width measured, whatever the file's size.

    python3 experiments/read_threads.py --rounds 11 --sizes 64MiB 256MiB 1GiB --dir /tmp/read-threads
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import benchlib  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--sizes", nargs="+", default=["64MiB", "256MiB", "1GiB"])
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()

    import torch

    import gdsckpt
    from gdsckpt.io import PosixReader
    from gdsckpt.io.pools import Lane

    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)

    def reader(path: Path, threads: int) -> Any:
        opened = PosixReader(path)
        opened._lane = Lane("io", threads)
        return opened

    for size in args.sizes:
        width, depth = benchlib.shape_for_bytes(benchlib.parse_size(size))
        state = benchlib.build_state(width, depth, 1, "cpu")
        logical = benchlib.logical_bytes(state)
        path, torch_path = directory / f"{size}.gdsckpt", directory / f"{size}.pt"
        gdsckpt.save(state, path, codec="none")
        torch.save(state, torch_path)
        del state
        ways = {"1 thread": (path, lambda path=path: gdsckpt.load(reader(path, 1))),
                "2 threads": (path, lambda path=path: gdsckpt.load(reader(path, 2))),
                "torch.load": (torch_path, lambda torch_path=torch_path: torch.load(torch_path, weights_only=True))}
        seconds: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, (file, load) in ways.items():
                benchlib.make_cold(file)
                started = time.perf_counter()
                loaded = load()
                seconds[way].append(time.perf_counter() - started)
                del loaded
        for way, values in seconds.items():
            values.sort()
            median = statistics.median(values)
            print(f"{size:>7s} {way:10s} median {median * 1e3:7.1f} ms ({logical / median / 1e9:4.2f} GB/s)  "
                  f"q1 {values[len(values) // 4] * 1e3:7.1f}  fastest {values[0] * 1e3:7.1f}", flush=True)
        path.unlink()
        torch_path.unlink()


if __name__ == "__main__":
    main()
