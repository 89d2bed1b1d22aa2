"""GPU benchmark: gdsckpt against raw kvikio, torch.save/torch.load on one training state, one run.

The state: a GPT-style model (gdsckpt.demo.TinyGPT) trained ``--steps`` AdamW steps on random
tokens on the GPU; saved as bf16 weights + fp32 master weights + exp_avg + exp_avg_sq (the
mixed-precision layout). Writes are durable (fsync inside the timing); reads are cold (the file
is dropped from the page cache with posix_fadvise(DONTNEED) after an fsync). Prints a table and
writes JSON (host, date, versions, every figure).

    python3 benchmarks/gpu_bench.py --width 2048 --depth 8 --dir /root/bench --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import gdsckpt  # noqa: E402
from gdsckpt.demo import TinyGPT, bit_equal, train_steps  # noqa: E402


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def build_state(width: int, depth: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(vocab=8192, width=width, depth=depth, heads=16, context=128).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_steps(model, optimizer, steps, seed=0, batch=4, length=128)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {"model": {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()},
             "master": {n: p.detach().clone() for n, p in model.named_parameters()},
             "optimizer": {names[id(p)]: {k: v for k, v in s.items() if k != "step"}
                           for p, s in optimizer.state.items()}}
    torch.cuda.synchronize()
    return state


def tensors(state: dict) -> list[torch.Tensor]:
    out = []
    for value in state.values():
        out.extend(tensors(value) if isinstance(value, dict) else [value])
    return out


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dir", default="/tmp/gdsckpt-bench")
    parser.add_argument("--out", default="gpu-bench.json")
    args = parser.parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    state = build_state(args.width, args.depth, args.steps)
    flat = tensors(state)
    logical = sum(t.numel() * t.element_size() for t in flat)
    results: dict = {"host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                     "gdsckpt": gdsckpt.__version__, "logical_bytes": logical, "width": args.width,
                     "depth": args.depth, "steps": args.steps, "runs": {}}
    import kvikio

    results["kvikio"] = kvikio.__version__
    raw_path = directory / "raw.bin"

    def raw_write() -> None:
        with kvikio.CuFile(raw_path, "w") as f:
            offset, futures = 0, []
            for t in flat:
                view = t.reshape(-1).view(torch.uint8)
                futures.append(f.pwrite(view, view.numel(), offset))
                offset += view.numel()
            for future in futures:
                future.get()
        fd = os.open(raw_path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def raw_read() -> None:
        with kvikio.CuFile(raw_path, "r") as f:
            offset, futures = 0, []
            for t in flat:
                buf = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, device="cuda")
                futures.append(f.pread(buf, buf.numel(), offset))
                offset += buf.numel()
            for future in futures:
                future.get()

    ours = directory / "state.gdsckpt"
    theirs = directory / "state.pt"
    reports = {}

    def ours_save() -> None:
        reports["save"] = gdsckpt.save(state, ours)

    def theirs_save() -> None:
        with theirs.open("wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())

    loaded = {}
    runs = results["runs"]
    runs["kvikio_raw_write"] = logical / timed(raw_write) / 1e9
    runs["gdsckpt_save"] = logical / timed(ours_save) / 1e9
    runs["torch_save"] = logical / timed(theirs_save) / 1e9
    for path in (raw_path, ours, theirs):
        drop_cache(path)
    runs["kvikio_raw_read_cold"] = logical / timed(raw_read) / 1e9
    runs["gdsckpt_load_cold"] = logical / timed(lambda: loaded.__setitem__(
        "ours", gdsckpt.load(ours, device="cuda"))) / 1e9
    runs["torch_load_cold"] = logical / timed(lambda: loaded.__setitem__(
        "theirs", torch.load(theirs, map_location="cuda", weights_only=True))) / 1e9
    report = reports["save"]
    results["ratio"] = report.ratio
    results["codec"], results["backend"], results["chains"] = report.codec, report.backend, report.chains
    results["bit_exact"] = all(bit_equal(a, b) for a, b in zip(flat, tensors(loaded["ours"])))
    results["ratio_torch"] = logical / theirs.stat().st_size
    from gdsckpt.io import NullWriter
    from gdsckpt.pipeline.gpu_engine import GpuEngine
    from gdsckpt.pipeline.plan import plan_chunks
    from gdsckpt.pipeline.save import run_save
    from gdsckpt.state import flatten
    from gdsckpt.api import _build_index

    flat_state = flatten(state)
    config = gdsckpt.Config()
    plans = plan_chunks([(a.source.nbytes, a.source.itemsize, a.source.plane_width) for a in flat_state.arrays],
                        chunk_bytes=config.chunk_bytes, pack_below=config.pack_below)
    engine = GpuEngine([a.source for a in flat_state.arrays], codec="ans", byte_planes="auto", device_id=0,
                       chunk_bytes=config.chunk_bytes, max_staging_bytes=config.max_staging_bytes)
    seconds = timed(lambda: run_save(plans, engine, NullWriter(), max_inflight_bytes=config.max_staging_bytes,
                                     build_index=lambda r: _build_index(flat_state, r)))
    engine.close()
    runs["gdsckpt_null_sink"] = logical / seconds / 1e9
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"state: {logical / 2**30:.2f} GiB, ratio {results['ratio']:.3f} ({results['codec']}, "
          f"{results['backend']}), bit-exact {results['bit_exact']}")
    for name, value in runs.items():
        print(f"  {name:24} {value:8.2f} GB/s")
    for path in (raw_path, ours, theirs):
        path.unlink()


if __name__ == "__main__":
    main()
