"""Portable files from CUDA state: the CPU engine's zstd against nvCOMP's ANS, each figure next to
the raw speed of the same storage, the same state, in the same run (issue 19's targets).

The state (``benchlib.build_state``, about ``--size``: bf16 weights, fp32 master weights, AdamW
moments after ``--steps`` steps) lives on the GPU. In order, once each (files on ``--dir``):

- ``raw_write`` / ``raw_read``: kvikio writes every tensor's bytes back to back (fsync), then reads
  the file cold into one device buffer: the storage's limits;
- ``save_ans``: ``gdsckpt.save(codec="ans")`` (the GPU engine);
- ``save_auto``: ``gdsckpt.save`` with the defaults: the engine and codec ``codec="auto"`` chose and
  the figures behind the choice (``SaveReport.auto``);
- ``save_portable``: ``gdsckpt.save(portable=True)``;
- ratios of each file, whole and per dtype (``bf16`` weights separately: the exact stored bytes of
  the chunks that hold only that dtype);
- ``load_cuda/<file>``: each file read cold into CUDA tensors, against a cold kvikio read of the
  same file (``ratio x raw`` is the limit), compared bit for bit;
- ``cuda_hidden``: a child process with ``CUDA_VISIBLE_DEVICES=""`` loads the portable file cold
  into host memory (``--cores`` codec threads: all of the host's by default) and ``torch.load``s a
  ``torch.save`` file of the same state cold, compares the two bit for bit;
- ``convert``: ``gdsckpt.convert(ans, zstd copy, codec="zstd")`` from a cold source, against the
  storage's time to read the source and write the copy (raw speeds above), and the copy loaded
  bit-exact.

GB/s are logical tensor bytes (10**9) over wall seconds, durable writes (fsync) and cold reads
(``benchlib.make_cold``; drop_caches too where allowed). ``limits`` gives each figure over its
limit.

    python3 benchmarks/portable_bench.py --device cuda --size 8GiB --dir /root/portable --out portable.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from tier_bench import raw_device_read, raw_device_write, timed

GB = 1e9

_CHILD = r"""
import json, os, sys, time
import torch
import gdsckpt
from gdsckpt.demo import bit_equal
path, torch_path, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
assert not torch.cuda.is_available()
config = gdsckpt.Config(codec_threads=threads) if threads else gdsckpt.Config()
started = time.perf_counter()
ours = gdsckpt.load(path, device="cpu", config=config)
gdsckpt_seconds = time.perf_counter() - started
started = time.perf_counter()
theirs = torch.load(torch_path, map_location="cpu", weights_only=True)
torch_seconds = time.perf_counter() - started
def leaves(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{prefix}/{k}")
    else:
        yield prefix, obj
a, b = dict(leaves(ours)), dict(leaves(theirs))
same = a.keys() == b.keys() and all(bit_equal(a[k], b[k]) for k in a)
print(json.dumps({"gdsckpt_seconds": gdsckpt_seconds, "torch_seconds": torch_seconds, "bit_exact": same,
                  "threads": config.effective_codec_threads, "cores": os.cpu_count()}))
"""


def _dtype_ratios(path: Path) -> dict[str, float]:
    """Raw over stored bytes per dtype, from the chunks that hold arrays of that dtype only."""
    import gdsckpt

    info = gdsckpt.inspect(path)
    dtype_of = {t.key: t.dtype for t in info.tensors}
    raw: dict[str, int] = {}
    stored: dict[str, int] = {}
    for chunk in info.chunks:
        kinds = {dtype_of[key] for key, _ in chunk.arrays}
        if len(kinds) == 1:
            (kind,) = kinds
            raw[kind] = raw.get(kind, 0) + chunk.raw_bytes
            stored[kind] = stored.get(kind, 0) + chunk.stored_bytes
    return {kind: raw[kind] / stored[kind] for kind in raw if stored[kind]}


def run(report: benchlib.Report, directory: Path, args: argparse.Namespace) -> None:
    import gdsckpt

    device = args.device
    state, logical = benchlib.sized_state(report, args.size, args.steps, device)
    results, limits = report["results"], report["limits"]
    drop = benchlib.can_drop_caches()
    report["state"]["drop_caches"] = drop

    def record(name: str, seconds: float, nbytes: int = logical, **extra: Any) -> float:
        gbps = nbytes / seconds / GB
        results[name] = {"gbps": gbps, "seconds": seconds, **extra}
        report.write()
        return gbps

    def cold(path: Path) -> None:
        benchlib.make_cold(path, drop_caches=drop)

    benchlib.warm_up(directory, device)
    raw = directory / "raw.bin"
    raw_write = record("raw_write", timed(raw_device_write(state, raw, args.kvikio_threads), device)[0])
    cold(raw)
    raw_read = record("raw_read", timed(raw_device_read(raw, args.kvikio_threads, 16 << 20), device)[0])
    benchlib.remove(raw)

    files: dict[str, Path] = {}
    saves = {"ans": {"codec": "ans"}, "auto": {}, "portable": {"portable": True}}
    for name, kwargs in saves.items():
        path = directory / f"{name}.gdsckpt"
        seconds, saved = timed(lambda path=path, kwargs=kwargs: gdsckpt.save(state, path, **kwargs), device)
        files[name] = path
        info = gdsckpt.inspect(path)
        gbps = record(f"save_{name}", seconds, ratio=saved.ratio, engine=saved.engine, codec=saved.codec,
                      chains=saved.chains, auto=saved.auto, portable=info.portable, dtype_ratios=_dtype_ratios(path))
        limits[f"save_{name}"] = gbps / (saved.ratio * raw_write)
    ans_gbps, ans_ratio = results["save_ans"]["gbps"], results["save_ans"]["ratio"]
    for name in ("auto", "portable"):
        limits[f"save_{name}_over_ans"] = results[f"save_{name}"]["gbps"] / ans_gbps
        limits[f"ratio_{name}_over_ans"] = results[f"save_{name}"]["ratio"] / ans_ratio

    for name, path in files.items():
        cold(path)
        seconds, loaded = timed(lambda path=path: gdsckpt.load(path, device=device), device)
        report.check(f"load_cuda/{name}", benchlib.differences(state, loaded, tensors_only=True))
        del loaded
        gbps = record(f"load_cuda/{name}", seconds)
        cold(path)
        file_bytes = path.stat().st_size
        file_read = record(f"raw_read/{name}", timed(raw_device_read(path, args.kvikio_threads, 16 << 20),
                                                     device)[0], nbytes=file_bytes)
        limits[f"load_cuda/{name}"] = gbps / (logical / file_bytes * file_read)
    benchlib.remove(files.pop("auto"))

    torch_file = directory / "state.pt"
    record("torch_save", timed(lambda: benchlib.durable_torch_save(state, torch_file), device)[0])
    cold(files["portable"])
    cold(torch_file)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    child = subprocess.run([sys.executable, "-c", _CHILD, str(files["portable"]), str(torch_file), str(args.cores)],
                           env=env, capture_output=True, text=True, timeout=args.child_timeout)
    if child.returncode != 0:
        raise RuntimeError(f"the CUDA-hidden child failed: {child.stderr[-2000:]}")
    hidden = json.loads(child.stdout.strip().splitlines()[-1])
    report.check("cuda_hidden", [] if hidden["bit_exact"] else ["the portable file and torch.load differ"])
    gbps = record("cuda_hidden/gdsckpt", hidden["gdsckpt_seconds"], threads=hidden["threads"], cores=hidden["cores"])
    torch_gbps = record("cuda_hidden/torch_load", hidden["torch_seconds"])
    limits["cuda_hidden_over_torch_load"] = gbps / torch_gbps
    benchlib.remove(torch_file)

    copy = directory / "converted.gdsckpt"
    cold(files["ans"])
    seconds, converted = timed(lambda: gdsckpt.convert(files["ans"], copy, codec="zstd"), device)
    in_bytes, out_bytes = files["ans"].stat().st_size, copy.stat().st_size
    storage_seconds = in_bytes / (raw_read * GB) + out_bytes / (raw_write * GB)
    gbps = record("convert_ans_to_zstd", seconds, in_bytes=in_bytes, out_bytes=out_bytes,
                  portable=gdsckpt.inspect(copy).portable)
    limits["convert_ans_to_zstd"] = gbps / (logical / storage_seconds / GB)
    cold(copy)
    loaded = gdsckpt.load(copy, device=device)
    report.check("convert_ans_to_zstd", benchlib.differences(state, loaded, tensors_only=True))
    del loaded, converted


def show(report: benchlib.Report) -> None:
    results, limits = report["results"], report["limits"]
    print(f"\n{'measure':28} {'GB/s':>8} {'ratio':>7}  engine/codec")
    for name, entry in results.items():
        ratio = entry.get("ratio")
        what = f"{entry.get('engine', '')} {entry.get('codec', '')}".strip()
        print(f"{name:28} {entry['gbps']:8.2f} {ratio if ratio is None else round(ratio, 3)!s:>7}  {what}")
    print("\nlimits (measured over its limit):")
    for name, value in limits.items():
        print(f"  {name:30} {value:6.3f}")
    auto = results.get("save_auto", {}).get("auto")
    if auto:
        print(f"\nauto: {json.dumps(auto, default=str)[:600]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda",), default="cuda")
    parser.add_argument("--size", default="8GiB", help="state size (e.g. 8GiB)")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps before saving")
    parser.add_argument("--kvikio-threads", type=int, default=16)
    parser.add_argument("--cores", type=int, default=0, help="codec threads of the CUDA-hidden load (0: all)")
    parser.add_argument("--child-timeout", type=float, default=240.0)
    parser.add_argument("--dir", default="/tmp/gdsckpt-portable")
    parser.add_argument("--out", default="portable-bench.json")
    args = parser.parse_args()
    return benchlib.run_benchmark("portable_bench", args, lambda report, directory: run(report, directory, args), show)


if __name__ == "__main__":
    sys.exit(main())
