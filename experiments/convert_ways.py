"""Where a windowed convert (ANS file -> portable zstd, ``gdsckpt.convert``) spends its time, and
what larger windows or reading the next window ahead change. GPU host.

The state (``benchlib.build_state``, about ``--size``) is saved once with ``codec="ans"``. Then,
each from a cold source:

- ``raw_write`` / ``raw_read``: kvikio writes the state's bytes (fsync) and reads them back cold,
  as ``benchmarks/portable_bench.py`` measures the storage; the convert's limit is the time to
  read the ANS file plus the time to write the zstd copy at these speeds;
- ``fetch/<window>``: the source's windows read one after another into host memory (what the
  convert's codec threads ask ``state.delta.BaseReader`` for), nothing encoded or written;
- ``convert/<way>``: ``gdsckpt.convert(ans, copy, codec="zstd")``, ways round-robin for
  ``--rounds`` rounds: windows of ``64MiB`` and ``256MiB`` (``api.saving.REWRITE_WINDOW_BYTES``;
  the library's default is ``max_inflight_bytes``, 256 MiB), each without and with ``+ahead``
  (``REWRITE_READ_AHEAD``, the default: the next window fetched on a thread of its own).

Each convert records every window fetch (start, end, bytes) so the report says how much of the
convert the fetches took and how long the codec threads waited on them.

    python3 experiments/convert_ways.py --size 4GiB --rounds 2 --dir /root/convert --out convert.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import benchlib
from tier_bench import raw_device_read, raw_device_write, timed

GB = 1e9


def _patches(window: int, ahead: bool, fetches: list[tuple[float, float, int]]) -> list[tuple[Any, str, Any]]:
    """(owner, attribute, new value) of one way: ``rewrite``'s window and read-ahead, a fetch log."""
    from gdsckpt.api import saving
    from gdsckpt.state import delta

    original_fetch = delta.BaseReader._fetch

    def logged_fetch(self: Any, batch: Any, device: Any, future: Any) -> Any:
        started = time.perf_counter()
        try:
            return original_fetch(self, batch, device, future)
        finally:
            fetches.append((started, time.perf_counter(), sum(high - low for _key, low, high in batch)))

    return [(saving, "REWRITE_WINDOW_BYTES", window), (saving, "REWRITE_READ_AHEAD", ahead),
            (delta.BaseReader, "_fetch", logged_fetch)]


def _patched(patches: list[tuple[Any, str, Any]]) -> list[tuple[Any, str, Any]]:
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _new in patches]
    for owner, attr, new in patches:
        setattr(owner, attr, new)
    return saved


def _fetch_summary(fetches: list[tuple[float, float, int]], started: float, seconds: float) -> dict[str, Any]:
    busy = sum(end - begin for begin, end, _n in fetches)
    gaps = [b2 - e1 for (_b1, e1, _n1), (b2, _e2, _n2) in zip(fetches, fetches[1:])]
    return {"fetches": len(fetches), "fetch_bytes": sum(n for _b, _e, n in fetches),
            "fetch_busy_s": busy, "fetch_busy_fraction": busy / seconds,
            "first_fetch_s": fetches[0][0] - started if fetches else None,
            "last_fetch_end_s": fetches[-1][1] - started if fetches else None,
            "gap_median_ms": 1e3 * (benchlib.median(gaps) or 0.0),
            "fetch_median_ms": 1e3 * (benchlib.median([e - b for b, e, _n in fetches]) or 0.0)}


def _raw_write(state: Any, path: Path, device: str) -> Any:
    """The state's bytes written back to back, fsync (kvikio from the device on ``cuda``)."""
    if device != "cpu":
        return raw_device_write(state, path, 16)
    import os

    views = [t.detach().reshape(-1).view(__import__("torch").uint8).numpy() for t in benchlib.flatten(state)[0].values()]

    def write() -> None:
        with open(path, "wb") as handle:
            for view in views:
                handle.write(view)
            handle.flush()
            os.fsync(handle.fileno())
    return write


def _raw_read(path: Path, device: str) -> Any:
    """The whole file read into one new buffer (kvikio into device memory on ``cuda``)."""
    if device != "cpu":
        return raw_device_read(path, 16, 16 << 20)
    import numpy as np

    def read() -> Any:
        out = np.empty(path.stat().st_size, dtype=np.uint8)
        with open(path, "rb", buffering=0) as handle:
            handle.readinto(memoryview(out))
        return out
    return read


def run(report: benchlib.Report, directory: Path, args: argparse.Namespace) -> None:
    import gdsckpt
    from gdsckpt.api.checkpoint import Checkpoint, base_arrays

    device = args.device
    state, logical = benchlib.sized_state(report, args.size, args.steps, device)
    results = report["results"]
    drop = benchlib.can_drop_caches()
    benchlib.warm_up(directory, device)

    raw = directory / "raw.bin"
    raw_write = logical / timed(_raw_write(state, raw, device), device)[0] / GB
    benchlib.make_cold(raw, drop_caches=drop)
    raw_read = logical / timed(_raw_read(raw, device), device)[0] / GB
    benchlib.remove(raw)
    results["raw_write"], results["raw_read"] = {"gbps": raw_write}, {"gbps": raw_read}

    ans = directory / "ans.gdsckpt"
    gdsckpt.save(state, ans, codec=args.source_codec)
    in_bytes = ans.stat().st_size
    report.write()

    for window in (64 << 20, 256 << 20):
        fetches: list[tuple[float, float, int]] = []
        saved = _patched(_patches(window, False, fetches))
        try:
            benchlib.make_cold(ans, drop_caches=drop)
            started = time.perf_counter()
            with Checkpoint(ans) as checkpoint:
                reader = base_arrays(checkpoint, window_bytes=window)
                for key, nbytes in list(reader._sizes.items()):  # the reader's own order
                    for low in range(0, nbytes, window):
                        reader.read(key, low, min(nbytes, low + 1), None)
            seconds = time.perf_counter() - started
        finally:
            _patched(saved)
        results[f"fetch/{window >> 20}MiB"] = {"gbps": logical / seconds / GB, "seconds": seconds,
                                                **_fetch_summary(fetches, started, seconds)}
        report.write()

    ways = {"64MiB": (64 << 20, False), "64MiB+ahead": (64 << 20, True),
            "256MiB": (256 << 20, False), "256MiB+ahead": (256 << 20, True)}
    for _round in range(args.rounds):
        for name, (window, ahead) in ways.items():
            fetches = []
            copy = directory / "copy.gdsckpt"
            saved = _patched(_patches(window, ahead, fetches))
            try:
                benchlib.make_cold(ans, drop_caches=drop)
                started = time.perf_counter()
                gdsckpt.convert(ans, copy, codec="zstd")
                seconds = time.perf_counter() - started
            finally:
                _patched(saved)
            out_bytes = copy.stat().st_size
            storage_seconds = in_bytes / (raw_read * GB) + out_bytes / (raw_write * GB)
            entry = {"seconds": seconds, "gbps": logical / seconds / GB, "out_bytes": out_bytes,
                     "x_read_plus_write": storage_seconds / seconds, **_fetch_summary(fetches, started, seconds)}
            if _round == 0:
                loaded = gdsckpt.load(copy, device=device)
                report.check(f"convert/{name}", benchlib.differences(state, loaded, tensors_only=True))
                del loaded
            results.setdefault(f"convert/{name}", {"rounds": []})["rounds"].append(entry)
            benchlib.remove(copy)
            report.write()
    for name in ways:
        rounds = results[f"convert/{name}"]["rounds"]
        results[f"convert/{name}"].update(
            gbps=benchlib.median([r["gbps"] for r in rounds]),
            x_read_plus_write=benchlib.median([r["x_read_plus_write"] for r in rounds]))
    report.write()
    del state


def show(report: benchlib.Report) -> None:
    for name, entry in report["results"].items():
        extra = ""
        if "x_read_plus_write" in entry:
            extra = f"  x(read+write) {entry['x_read_plus_write']:.3f}"
        if "rounds" in entry:
            extra += "  fetch busy " + " ".join(f"{r['fetch_busy_fraction']:.2f}" for r in entry["rounds"])
            extra += "  gaps ms " + " ".join(f"{r['gap_median_ms']:.1f}" for r in entry["rounds"])
        elif "fetches" in entry:
            extra = f"  {entry['fetches']} fetches, median {entry['fetch_median_ms']:.1f} ms"
        print(f"{name:24} {entry.get('gbps', float('nan')):7.2f} GB/s{extra}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4GiB")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/gdsckpt-convert")
    parser.add_argument("--out", default="convert-ways.json")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the same code on the CPU engine")
    parser.add_argument("--source-codec", default=None, help="default: ans on cuda, lz4 on cpu")
    args = parser.parse_args()
    args.source_codec = args.source_codec or ("ans" if args.device == "cuda" else "lz4")
    return benchlib.run_benchmark("convert_ways", args, lambda report, directory: run(report, directory, args), show)


if __name__ == "__main__":
    sys.exit(main())
