"""What a GPU restore's chunk reads cost on their own: the same reads a restore submits (each
chunk's stored bytes, in file order, a bounded number in flight, each into its own place in one
device buffer), through ``kvikio.CuFile.pread``, against one raw read of the same bytes, with the
time spent inside each ``pread`` call (its submission: the restore's one driver thread pays it
before it can submit the next read) reported beside the total.

Why: on one lent GPU host a warm 8.9 GB restore took 1.4-3.3 s against a 160 ms raw read of the
file, whatever the code version (the version that had measured 194 ms there the day before, too);
a cProfile put 2.4 s of a 3.3 s restore inside kvikio's ``pread`` (2,123 calls, 1.1 ms each).
kvikio reads a device buffer smaller than its ``gds_threshold`` (1 MiB by default) synchronously
in the calling thread, and submits larger ones to its thread pool. This probe separates the
candidates: the read pattern alone (no decoding), small reads (the synchronous path) against
``gds_threshold=0``, fewer pool threads than cores, a busy Python thread (the decoder worker holds
the GIL), the GPU busy on another stream (the decoder's kernels), and small reads submitted while
a large read fills the copy engine.

Reads go into one device buffer (``--window``, default 1 GiB) as a ring; a read is submitted
only once the read that last used its bytes has finished. Prints kvikio's settings and the
``KVIKIO_*`` / ``CUDA_*`` environment first, then one line per case (medians of ``--repeat``).

    python3 experiments/pread_calls.py --size 8GiB --dir /root/pread
    python3 experiments/pread_calls.py --checkpoint /root/tier/state.gdsckpt
    python3 experiments/pread_calls.py --threads-only     # any host, no GPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import benchlib  # noqa: E402
import tier_bench  # noqa: E402

ALIGN = 4096


def chunk_ranges(path: Path) -> list[tuple[int, int]]:
    """(offset, stored bytes) of every chunk of a gdsckpt file, in file order."""
    import gdsckpt
    from gdsckpt.api.resolve import open_checked, open_reader, resolve_config

    with open_reader(path, resolve_config(gdsckpt.Config())) as reader:
        index = open_checked(reader).index
    return sorted((record.offset, record.stored) for record in index.chunks)


def timed_reads(cufile: Any, window: Any, ranges: list[tuple[int, int]], in_flight: int) -> tuple[float, float]:
    """Submit ``ranges`` in order into ``window`` (a ring), at most ``in_flight`` outstanding;
    returns (seconds inside ``pread`` calls, seconds in all)."""
    capacity = int(window.nbytes)
    outstanding: deque[tuple[Any, int, int]] = deque()  # future, ring start, ring end
    position = 0
    inside = 0.0
    started = time.perf_counter()
    for offset, length in ranges:
        span = (length + ALIGN - 1) // ALIGN * ALIGN
        if position + span > capacity:
            position = 0
        # wait for every outstanding read that overlaps [position, position + span), and keep
        # at most ``in_flight`` outstanding
        while outstanding and (len(outstanding) >= in_flight
                               or any(start < position + span and end > position
                                      for _future, start, end in outstanding)):
            outstanding.popleft()[0].get()
        entered = time.perf_counter()
        future = cufile.pread(window[position:position + length], length, offset)
        inside += time.perf_counter() - entered
        outstanding.append((future, position, position + span))
        position += span
    while outstanding:
        outstanding.popleft()[0].get()
    return inside, time.perf_counter() - started


@contextlib.contextmanager
def in_background(work: Callable[[threading.Event], None], settle: float = 0.0) -> Iterator[None]:
    """``work(stop)`` on a thread of its own for the block (given ``settle`` seconds to start)."""
    stop = threading.Event()
    thread = threading.Thread(target=work, args=(stop,), daemon=True)
    thread.start()
    time.sleep(settle)
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def spin_python(stop: threading.Event) -> None:
    """Run Python (holding the GIL between switches) until ``stop``."""
    count = 0
    while not stop.is_set():
        count += 1


def queue_kernels(stop: threading.Event) -> None:
    """Queue kernels back to back on a non-blocking stream of this thread's own until ``stop``."""
    import cupy

    cupy.cuda.Device(0).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    values = cupy.ones(256 << 20, dtype=cupy.float32)
    with stream:
        while not stop.is_set():
            for _ in range(20):
                values *= 1.0001
            stream.synchronize()


@contextlib.contextmanager
def large_read_in_flight(cufile: Any, size: int) -> Iterator[None]:
    """One large read (the file's first bytes into a buffer of its own) running under the block."""
    import cupy

    target = cupy.empty(size, dtype=cupy.uint8)
    future = cufile.pread(target, size, 0)
    try:
        yield
    finally:
        future.get()


def wake_round_trip(rounds: int = 2000) -> float:
    """Median seconds for one thread to wake another and be woken back (two ``threading.Event``
    hand-offs, each a GIL hand-off too): what every read submitted from one Python thread and
    decoded in another pays at least once, and the figure that differs between virtual machines."""
    ping, pong = threading.Event(), threading.Event()

    def echo() -> None:
        for _ in range(rounds):
            ping.wait()
            ping.clear()
            pong.set()

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        ping.set()
        pong.wait()
        pong.clear()
        times.append(time.perf_counter() - started)
    thread.join(timeout=10)
    return statistics.median(times)


def gil_waits(path: Path, calls: int = 300, rounds: int = 5) -> list[tuple[float, float]]:
    """Per round, seconds in all for ``calls`` reads of 4 KiB (``os.pread``, which releases the
    GIL) alone, then beside a new thread running Python: the cost of taking the GIL back after
    each. Rounds differ (whether the other thread gets the GIL at all varies), hence several."""
    handle = os.open(path, os.O_RDONLY)

    def run() -> float:
        started = time.perf_counter()
        for _ in range(calls):
            os.pread(handle, 4096, 0)
        return time.perf_counter() - started

    try:
        results = []
        for _ in range(rounds):
            alone = run()
            with in_background(spin_python, settle=0.01):
                beside = run()
            results.append((alone, beside))
        return results
    finally:
        os.close(handle)


@contextlib.contextmanager
def kvikio_default(key: str, value: Any) -> Iterator[None]:
    """``kvikio.defaults`` ``key`` set to ``value`` for the block."""
    import kvikio.defaults

    saved = kvikio.defaults.get(key)
    kvikio.defaults.set(key, value)
    try:
        yield
    finally:
        kvikio.defaults.set(key, saved)


@contextlib.contextmanager
def switch_interval(seconds: float) -> Iterator[None]:
    """``sys.setswitchinterval(seconds)`` for the block."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(saved)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="an existing gdsckpt file (else one is saved)")
    parser.add_argument("--size", default="8GiB", help="state to save when --checkpoint is not given")
    parser.add_argument("--dir", default="/tmp/pread-calls")
    parser.add_argument("--window", default="1GiB", help="the device buffer the reads land in")
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads-only", action="store_true",
                        help="only the host's thread hand-offs (no GPU needed): wake-up round trip and GIL waits")
    args = parser.parse_args()
    print(f"thread wake-up round trip: {wake_round_trip() * 1e6:.1f} us (median)")
    rounds = gil_waits(Path(__file__))
    print("300 reads of 4 KiB, ms alone / beside a thread running Python, per round: "
          + ", ".join(f"{alone * 1e3:.1f} / {beside * 1e3:.1f}" for alone, beside in rounds))
    if args.threads_only:
        return 0

    import cupy
    import kvikio
    import kvikio.defaults

    import gdsckpt

    if args.checkpoint:
        path = Path(args.checkpoint)
    else:
        directory = Path(args.dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "state.gdsckpt"
        width, depth = benchlib.shape_for_bytes(benchlib.parse_size(args.size))
        state = benchlib.build_state(width, depth, 2, "cuda")
        gdsckpt.save(state, path)
        del state
    tier_bench.read_warm(path)
    ranges = chunk_ranges(path)
    sizes = [length for _offset, length in ranges]
    stored = sum(sizes)
    first, last = ranges[0][0], ranges[-1][0] + ranges[-1][1]
    print(f"file {path} {path.stat().st_size / 1e9:.2f} GB, {len(ranges)} chunks, {stored / 1e9:.2f} GB stored; "
          f"chunks under 1 MiB: {sum(s < (1 << 20) for s in sizes)}, 1-4 MiB: "
          f"{sum((1 << 20) <= s < (4 << 20) for s in sizes)}, 4 MiB and over: {sum(s >= (4 << 20) for s in sizes)}")
    kvikio.defaults.set("thread_pool_nthreads", args.threads)
    settings = {key: kvikio.defaults.get(key) for key in
                ("compat_mode", "thread_pool_nthreads", "task_size", "gds_threshold", "bounce_buffer_size")}
    print(f"kvikio {kvikio.__version__} {settings}; cores {os.cpu_count()}")
    print("env:", {k: v for k, v in os.environ.items() if k.startswith(("KVIKIO_", "CUDA_", "CUFILE_"))})

    window = cupy.empty(benchlib.parse_size(args.window), dtype=cupy.uint8)
    whole = cupy.empty(last - first, dtype=cupy.uint8)
    cufile = kvikio.CuFile(path, "r")
    small = [(first + i * (512 << 10), 512 << 10) for i in range(256)]
    medium = [(first + i * (4 << 20), 4 << 20) for i in range(256)]
    large = [(first + i * (64 << 20), 64 << 20) for i in range(16)]

    def case(label: str, work: Callable[[], tuple[float, float, int, int]]) -> None:
        inside, total = [], []
        for _ in range(args.repeat):
            seconds_inside, seconds, calls, nbytes = work()
            inside.append(seconds_inside / calls * 1e3)
            total.append(seconds)
        seconds = statistics.median(total)
        print(f"  {label:52s} inside pread {statistics.median(inside):6.3f} ms/call   "
              f"total {seconds * 1e3:8.1f} ms  {nbytes / seconds / 1e9:6.2f} GB/s")

    def raw() -> tuple[float, float, int, int]:
        entered = time.perf_counter()
        future = cufile.pread(whole, last - first, first)
        inside = time.perf_counter() - entered
        future.get()
        return inside, time.perf_counter() - entered, 1, last - first

    def pattern(chosen: list[tuple[int, int]], in_flight: int = args.in_flight) -> Callable[[], tuple[float, float, int, int]]:
        def run() -> tuple[float, float, int, int]:
            inside, total = timed_reads(cufile, window, chosen, in_flight)
            return inside, total, len(chosen), sum(length for _offset, length in chosen)
        return run

    def under(context: Callable[[], Any], work: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with context():
                return work()
        return run

    case("raw: one pread of the chunk region", raw)
    case(f"the restore's chunk reads, {args.in_flight} in flight", pattern(ranges))
    case("  the same, gds_threshold 0 (no read in this thread)",
         under(lambda: kvikio_default("gds_threshold", 0), pattern(ranges)))
    case("  the same, 8 pool threads", under(lambda: kvikio_default("thread_pool_nthreads", 8), pattern(ranges)))
    case("  the same, 4 in flight", pattern(ranges, 4))
    case("  the same, a Python thread busy", under(lambda: in_background(spin_python), pattern(ranges)))
    case("  the same, the GPU busy on another stream",
         under(lambda: in_background(queue_kernels, settle=0.3), pattern(ranges)))
    case("256 reads of 512 KiB (under gds_threshold)", pattern(small))
    case("  the same, gds_threshold 0", under(lambda: kvikio_default("gds_threshold", 0), pattern(small)))
    case("  the same, under a 1 GiB read in flight", under(lambda: large_read_in_flight(cufile, 1 << 30),
                                                             pattern(small)))
    case("  the same, a Python thread busy, switch interval 0.5 ms",
         under(lambda: in_background(spin_python), under(lambda: switch_interval(0.0005), pattern(ranges))))
    case("256 reads of 4 MiB", pattern(medium))
    case("  the same, a Python thread busy", under(lambda: in_background(spin_python), pattern(medium)))
    case("16 reads of 64 MiB (the same bytes)", pattern(large))
    case("  the same, a Python thread busy", under(lambda: in_background(spin_python), pattern(large)))
    case("  the same, under a 1 GiB read in flight", under(lambda: large_read_in_flight(cufile, 1 << 30),
                                                             pattern(medium)))
    cufile.close()
    if not args.checkpoint:
        path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
