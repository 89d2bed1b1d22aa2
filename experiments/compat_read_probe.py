"""Can a host-bounce reader beat kvikio's own POSIX (compatibility-mode) read into device memory?

Reads one file (in the page cache, or on tmpfs) whole into a device buffer, round-robin:

- ``kvikio``: ``CuFile.pread`` with kvikio's thread pool (``--threads``, its default task size);
- ``bounce``: this script's threads, each with two pinned buffers and a CUDA stream of its own,
  taking the next ``task``-sized piece: ``preadv`` into one pinned buffer while the other's
  host-to-device copy runs (``cudaMemcpyAsync``), an event guarding each buffer's reuse;
- ``h2d``: the host-to-device copies alone, from one pinned buffer of the same size, on as many
  streams: the limit of any bounce.

Every read is checked against the first kvikio read (bit for bit, on the device). Prints GB/s
medians per configuration. Usage (GPU host)::

    python3 experiments/compat_read_probe.py --file /root/tier/file.bin --rounds 3 \\
        --threads 16,32 --tasks 4MiB,16MiB
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import threading
import time

import cupy
import cupyx
import kvikio
import kvikio.defaults
import numpy as np


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def kvikio_read(path: str, device: cupy.ndarray, size: int, threads: int) -> float:
    kvikio.defaults.set("thread_pool_nthreads", threads)
    started = time.perf_counter()
    with kvikio.CuFile(path, "r") as handle:
        handle.pread(device, size, 0).get()
    return time.perf_counter() - started


def bounce_read(path: str, device: cupy.ndarray, size: int, threads: int, task: int,
                pinned: list[list[np.ndarray]], streams: list[cupy.cuda.Stream]) -> float:
    pieces = list(range(0, size, task))
    counter = itertools.count()
    errors: list[BaseException] = []
    base = device.data.ptr

    def worker(k: int) -> None:
        try:
            cupy.cuda.Device(device.device.id).use()
            fd = os.open(path, os.O_RDONLY)
            guards: list[cupy.cuda.Event | None] = [None, None]
            stream = streams[k]
            turn = 0
            try:
                while True:
                    i = next(counter)
                    if i >= len(pieces):
                        break
                    offset = pieces[i]
                    nbytes = min(task, size - offset)
                    slot = turn % 2
                    guard = guards[slot]
                    if guard is not None:
                        guard.synchronize()
                    buffer = pinned[k][slot]
                    view = memoryview(buffer)[:nbytes]
                    done = 0
                    while done < nbytes:
                        got = os.preadv(fd, [view[done:]], offset + done)
                        if got <= 0:
                            raise OSError("short read")
                        done += got
                    cupy.cuda.runtime.memcpyAsync(base + offset, buffer.ctypes.data, nbytes,
                                                  cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
                    event = cupy.cuda.Event(block=False, disable_timing=True)
                    event.record(stream)
                    guards[slot] = event
                    turn += 1
                stream.synchronize()
            finally:
                os.close(fd)
        except BaseException as err:  # noqa: BLE001 - reported by the caller
            errors.append(err)

    started = time.perf_counter()
    workers = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for each in workers:
        each.start()
    for each in workers:
        each.join(60)
    seconds = time.perf_counter() - started
    if errors:
        raise errors[0]
    return seconds


def h2d_only(device: cupy.ndarray, size: int, threads: int, task: int, host: np.ndarray,
             streams: list[cupy.cuda.Stream]) -> float:
    started = time.perf_counter()
    base = device.data.ptr
    for i, offset in enumerate(range(0, size, task)):
        nbytes = min(task, size - offset)
        cupy.cuda.runtime.memcpyAsync(base + offset, host.ctypes.data, nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, streams[i % threads].ptr)
    for stream in streams[:threads]:
        stream.synchronize()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", default="16")
    parser.add_argument("--tasks", default="4MiB,16MiB")
    args = parser.parse_args()
    size = os.path.getsize(args.file)
    thread_counts = [int(t) for t in args.threads.split(",")]
    tasks = [parse_size(t) for t in args.tasks.split(",")]
    device = cupy.empty(size, dtype=cupy.uint8)
    reference = cupy.empty(size, dtype=cupy.uint8)
    kvikio_read(args.file, reference, size, max(thread_counts))
    most = max(thread_counts)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(most)]
    pinned = {task: [[cupyx.empty_pinned(task, dtype=np.uint8) for _ in range(2)] for _ in range(most)] for task in tasks}
    host = cupyx.empty_pinned(max(tasks), dtype=np.uint8)
    results: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for threads in thread_counts:
            device.fill(0)
            results.setdefault(f"kvikio threads={threads}", []).append(
                size / kvikio_read(args.file, device, size, threads) / 1e9)
            assert bool((device == reference).all()), "kvikio read differs"
            for task in tasks:
                device.fill(0)
                cupy.cuda.Device().synchronize()
                seconds = bounce_read(args.file, device, size, threads, task, pinned[task], streams)
                results.setdefault(f"bounce threads={threads} task={task >> 20}MiB", []).append(size / seconds / 1e9)
                assert bool((device == reference).all()), "bounce read differs"
                results.setdefault(f"h2d only streams={threads} task={task >> 20}MiB", []).append(
                    size / h2d_only(device, size, threads, task, host, streams) / 1e9)
    print(f"file {args.file}: {size / 1e9:.2f} GB, medians of {args.rounds} (GB/s)")
    for label, values in results.items():
        print(f"  {label:40s} {statistics.median(values):6.1f}   ({', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
