"""Which path restores a portable (CPU-engine zstd) file into CUDA tensors fastest, and what a
windowed convert gains from keeping one engine and reading ahead. GPU host.

Restores (each cold, ``--rounds`` rounds round-robin, next to a cold kvikio read of the same file):
- ``gpu/4MiB``: the portable file as the CPU engine writes it (4 MiB chunks), the default restore
  (GPU engine: kvikio reads, checksums, nvCOMP's Zstd);
- ``cpu/4MiB``: the same file, ``Config(engine="cpu")``: the CPU engine decodes on every core, the
  targets copy to the device;
- ``gpu/16MiB`` and ``cpu/16MiB``: a portable file saved with 16 MiB chunks, both ways.

Converts (ANS file to zstd, cold source, one run each): as the library does now (one engine for
every window), and with an engine made per window as before (``Checkpoint._read_many`` patched to
the former code). Run 16 also measured a ``BaseReader`` that read the next window ahead on a
thread of its own (patched out as ``no_read_ahead``): slower, so it was removed.

    python3 experiments/portable_paths.py --size 4GiB --dir /root/paths --out paths.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import benchlib
from tier_bench import raw_device_read, timed

GB = 1e9


def _engine_per_window(self: Any, requests: list[tuple[str, int, int]], device: Any = None) -> list[Any]:
    """``Checkpoint._read_many`` as it was before it kept an engine: one per call."""
    from gdsckpt.api.checkpoint import new_target, restore_arrays
    from gdsckpt.api.resolve import open_data_reader, parse_device, restore_gpu_device
    from gdsckpt.format import TensorRecord

    index = self._opened.index
    target_device = parse_device(device)
    ids, windows, records = [], {}, {}
    for key, start, stop in requests:
        i = self._id(key)
        ids.append(i)
        windows[i] = (start, stop)
        records[i] = TensorRecord(key=key, kind="numpy", dtype="uint8", shape=(stop - start,))
    gpu_device = restore_gpu_device(self._config, target_device, index, ids)
    with open_data_reader(self._source, self._config, self._reader, gpu_device) as data_reader:
        arrays = restore_arrays(data_reader, self._opened, ids, self._config,
                                lambda i, _record: new_target(records[i], target_device), gpu_device, windows=windows)
    return [arrays[i] for i in ids]


def run(report: benchlib.Report, directory: Path, args: argparse.Namespace) -> None:
    import gdsckpt
    from gdsckpt.api.checkpoint import Checkpoint

    state, logical = benchlib.sized_state(report, args.size, args.steps, "cuda")
    results = report["results"]
    drop = benchlib.can_drop_caches()
    benchlib.warm_up(directory, "cuda")
    files = {"4MiB": directory / "p4.gdsckpt", "16MiB": directory / "p16.gdsckpt"}
    gdsckpt.save(state, files["4MiB"], codec="zstd")
    gdsckpt.save(state, files["16MiB"], codec="zstd", config=gdsckpt.Config(chunk_bytes=16 << 20))
    times: dict[str, list[float]] = {}
    for _round in range(args.rounds):
        for size, path in files.items():
            for engine in ("gpu", "cpu"):
                benchlib.make_cold(path, drop_caches=drop)
                config = gdsckpt.Config(engine="cpu") if engine == "cpu" else gdsckpt.Config()
                seconds, loaded = timed(lambda path=path, config=config: gdsckpt.load(path, device="cuda",
                                                                                      config=config), "cuda")
                report.check(f"{engine}/{size}", benchlib.differences(state, loaded, tensors_only=True))
                del loaded
                times.setdefault(f"{engine}/{size}", []).append(seconds)
            benchlib.make_cold(path, drop_caches=drop)
            raw, _ = timed(raw_device_read(path, 16, 16 << 20), "cuda")
            times.setdefault(f"raw/{size}", []).append(raw)
            report.write()
    for name, values in times.items():
        size = name.split("/")[1]
        nbytes = files[size].stat().st_size if name.startswith("raw") else logical
        median = benchlib.median(values) or float("nan")
        results[name] = {"gbps": nbytes / median / GB, "seconds": values}
    for name in list(results):
        if not name.startswith("raw"):
            size = name.split("/")[1]
            ratio = logical / files[size].stat().st_size
            results[name]["x_limit"] = results[name]["gbps"] / (ratio * results[f"raw/{size}"]["gbps"])
    report.write()

    ans = directory / "ans.gdsckpt"
    gdsckpt.save(state, ans, codec="ans")
    del state
    variants: dict[str, list[tuple[Any, str, Any]]] = {
        "now": [], "engine_per_window": [(Checkpoint, "_read_many", _engine_per_window)]}
    for name, patches in variants.items():
        saved = [(owner, attr, owner.__dict__[attr]) for owner, attr, _new in patches]
        for owner, attr, new in patches:
            setattr(owner, attr, new)
        try:
            benchlib.make_cold(ans, drop_caches=drop)
            copy = directory / f"conv-{name}.gdsckpt"
            started = time.perf_counter()
            gdsckpt.convert(ans, copy, codec="zstd")
            seconds = time.perf_counter() - started
        finally:
            for owner, attr, old in saved:
                setattr(owner, attr, old)
        results[f"convert/{name}"] = {"gbps": logical / seconds / GB, "seconds": seconds,
                                      "out_bytes": copy.stat().st_size}
        benchlib.remove(copy)
        report.write()


def show(report: benchlib.Report) -> None:
    for name, entry in report["results"].items():
        extra = f"  x_limit {entry['x_limit']:.3f}" if "x_limit" in entry else ""
        print(f"{name:28} {entry['gbps']:7.2f} GB/s{extra}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4GiB")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/gdsckpt-paths")
    parser.add_argument("--out", default="portable-paths.json")
    args = parser.parse_args()
    args.device = "cuda"
    return benchlib.run_benchmark("portable_paths", args, lambda report, directory: run(report, directory, args),
                                  show)


if __name__ == "__main__":
    sys.exit(main())
