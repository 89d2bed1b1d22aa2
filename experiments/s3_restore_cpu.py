"""Where a restore from ``s3://`` spends the host's cores when the server shares them: wall time
and CPU seconds of the client (this process) and of the server (SeaweedFS, started here on
127.0.0.1) for ``gdsckpt.load(url)``, ``gdsckpt.verify(url)`` (the same GETs and checksums, no
arrays) and a raw download of the same object (``obstore.get_ranges``, 64 MiB ranges 4 at a
time), round robin in one process; plus the client's extra work measured alone: copying the
file's bytes into new memory and their CRC-32C, on one thread.

The state is saved with the defaults to a local file and uploaded as it is (16 MiB parts); with
``--compressed`` it is saved as a ``CheckpointManager`` with a remote tier saves it (``codec="auto"``
compressing even where the local disk outruns it), the file a manager's upload restores from.

    python3 experiments/s3_restore_cpu.py --width 1024 --depth 6 --rounds 7
    python3 experiments/s3_restore_cpu.py --width 1024 --depth 6 --rounds 7 --compressed
    python3 experiments/s3_restore_cpu.py --rounds 7 --compressed --joins 32,64

``--joins``: more ways, ``gdsckpt.load`` with ``max_inflight_bytes`` 512 MiB (room for joined GETs
of 64 MiB on 8 threads) and joins of at most each size given (MiB), to weigh the size of the
largest GET (``io.s3.JOIN_READ_BYTES``); each way's minor page faults are printed too.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import benchlib  # noqa: E402
from seaweed import create_bucket, seaweedfs  # noqa: E402


def server_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (``/proc/PID/stat``)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def joined_load(url: str, join_bytes: int) -> Callable[[], Any]:
    """``gdsckpt.load(url)`` with room for 64 MiB GETs on 8 threads and joins of at most ``join_bytes``."""
    import gdsckpt
    from gdsckpt.api import resolve

    def run() -> Any:
        saved = resolve.JOIN_READ_BYTES
        resolve.JOIN_READ_BYTES = join_bytes
        try:
            return gdsckpt.load(url, config=gdsckpt.Config(max_inflight_bytes=512 << 20))
        finally:
            resolve.JOIN_READ_BYTES = saved
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compressed", action="store_true",
                        help="save as a manager with a remote tier does (may_store_as_is=False)")
    parser.add_argument("--joins", default="", help="comma-separated MiB: loads with joins of at most that")
    args = parser.parse_args()

    import numpy as np
    import obstore

    import gdsckpt
    from gdsckpt.format import checksum
    from gdsckpt.io.s3 import open_store

    state = benchlib.build_state(args.width, args.depth, 3, "cpu")
    with tempfile.TemporaryDirectory() as directory, seaweedfs(Path(directory) / "weed") as endpoint:
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="cpu", AWS_SECRET_ACCESS_KEY="cpu",
                          AWS_REGION="us-east-1")
        create_bucket(endpoint, "cpu")
        local = Path(directory) / "state.gdsckpt"
        if args.compressed:
            from gdsckpt.api.saving import save_flat
            from gdsckpt.state import flatten

            report = save_flat(flatten(state), local, codec="auto", config=gdsckpt.Config(), may_store_as_is=False)
        else:
            report = gdsckpt.save(state, local)
        store = open_store("cpu")
        obstore.put(store, "state.gdsckpt", local, use_multipart=True, chunk_size=16 << 20, max_concurrency=8)
        url = "s3://cpu/state.gdsckpt"
        size = local.stat().st_size
        starts = list(range(0, size, 64 << 20))
        ends = [min(start + (64 << 20), size) for start in starts]

        def raw_download() -> None:
            for first in range(0, len(starts), 4):
                obstore.get_ranges(store, "state.gdsckpt", starts=starts[first:first + 4], ends=ends[first:first + 4])

        server = [int(pid) for pid in subprocess.run(["pgrep", "-f", "weed"], capture_output=True,
                                                     text=True).stdout.split()]
        ways: dict[str, Callable[[], Any]] = {"gdsckpt.load": lambda: gdsckpt.load(url),
                                              "gdsckpt.verify": lambda: gdsckpt.verify(url),
                                              "raw download": raw_download}
        for mib in [int(text) for text in args.joins.split(",") if text]:
            ways[f"load, {mib} MiB joins"] = joined_load(url, mib << 20)
        measured: dict[str, list[tuple[float, float, float, float]]] = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, run in ways.items():
                own, theirs, started = os.times(), server_cpu_seconds(server), time.perf_counter()
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                result = run()
                wall = time.perf_counter() - started
                after = os.times()
                measured[way].append((wall, after.user + after.system - own.user - own.system,
                                      server_cpu_seconds(server) - theirs,
                                      resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
                del result
        data = np.frombuffer(local.read_bytes(), dtype=np.uint8)

    def alone(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(5):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    part = 32 << 20
    copy = alone(lambda: [np.empty(part, dtype=np.uint8).__setitem__(slice(None), data[s:s + part])
                          for s in range(0, size - part, part)])
    crc = alone(lambda: [checksum(data[s:s + part]) for s in range(0, size, part)])
    print(f"file {size / 1e9:.3f} GB (ratio {report.ratio:.3f}), {os.cpu_count()} cores shared with the server, "
          f"medians of {args.rounds}")
    for way, rows in measured.items():
        wall, client, server_cpu, faults = (statistics.median(row[i] for row in rows) for i in range(4))
        print(f"  {way:15s} wall {wall:.3f} s  client CPU {client:.2f} s  server CPU {server_cpu:.2f} s  "
              f"minor faults {faults / 1e3:.0f}k  (walls {', '.join(f'{row[0]:.2f}' for row in sorted(rows))})")
    print(f"  alone, one thread: copy into new memory {copy:.3f} s, CRC-32C {crc:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
