"""Delta and lossy checkpoints (issue 7), on the GPU, one run.

1. Deltas. For each interval K in ``--intervals``: a TinyGPT (as benchmarks/gpu_bench.py builds it:
   bf16 weights + fp32 master weights + AdamW exp_avg / exp_avg_sq) trains ``--warmup`` steps,
   then ``--count`` checkpoints are taken every K steps, each saved twice on the same data: in
   full, and as a delta against the previous delta-run checkpoint (the first one full, as a
   ``CheckpointManager`` with ``delta_every`` would). Bytes and durable save seconds of both;
   the last delta is loaded back and compared bit for bit.
   Targets: bf16-weight delta at K=10 >= 5x; the ``--count`` checkpoints at K=100 in <= 40% of the
   bytes of the full ones.
2. Lossy. The trained state is saved losslessly and with ``lossy={"*exp_avg": r, "*exp_avg_sq": r}``
   for each r in ``--lossy-bounds``; ratio of the Adam moments. Then training resumes ``--resume``
   steps from each (moments loaded from the file, the same batches) and the mean loss of the last
   10 steps is compared with resuming from the lossless one.
   Targets: lossy optimizer state >= 4x; resumed loss within 0.5% of lossless.

Writes JSON (host, date, versions, every figure, targets) and prints a table.

    python3 benchmarks/delta_bench.py --width 1024 --depth 4 --dir /root/delta-bench --out delta-bench.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import gdsckpt
from gdsckpt.demo import TinyGPT, bit_equal, train_steps

BATCH, LENGTH, VOCAB, HEADS = 4, 128, 8192, 16  # as benchmarks/gpu_bench.py
MOMENTS = ("exp_avg", "exp_avg_sq")
DEVICE = "cuda"


def sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def training(width: int, depth: int, warmup: int) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, width=width, depth=depth, heads=HEADS, context=LENGTH).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_steps(model, optimizer, warmup, seed=0, batch=BATCH, length=LENGTH)
    return model, optimizer


def state_of(model: TinyGPT, optimizer: torch.optim.Optimizer) -> dict:
    """A copy of the training state (bf16 weights, fp32 master weights, moments)."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {"model": {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()},
             "master": {n: p.detach().clone() for n, p in model.named_parameters()},
             "optimizer": {names[id(p)]: {k: s[k].clone() for k in MOMENTS} for p, s in optimizer.state.items()}}
    sync()
    return state


def group_bytes(path: Path) -> dict[str, list[int]]:
    """Group (top-level key) -> [logical bytes, stored bytes]."""
    groups: dict[str, list[int]] = {}
    for t in gdsckpt.inspect(path).tensors:
        if t.alias_of is None:
            entry = groups.setdefault(t.key.split("/")[0], [0, 0])
            entry[0] += t.nbytes
            entry[1] += t.stored_bytes
    return groups


def timed_save(state: dict, path: Path, **options) -> tuple[gdsckpt.SaveReport, float]:
    sync()
    started = time.perf_counter()
    report = gdsckpt.save(state, path, **options)
    return report, time.perf_counter() - started


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bit_equal(a, b)


def deltas(args: argparse.Namespace, interval: int, directory: Path) -> dict:
    model, optimizer = training(args.width, args.depth, args.warmup)
    rows, previous, first = [], None, None
    for i in range(args.count if interval < 1000 else args.count_1000):
        train_steps(model, optimizer, interval, seed=1 + i, batch=BATCH, length=LENGTH)
        state = state_of(model, optimizer)
        full_path, delta_path = directory / f"full-{i}.gdsckpt", directory / f"delta-{i}.gdsckpt"
        full, full_s = timed_save(state, full_path, codec=args.codec)
        base = previous if args.delta_base == "previous" else first  # a chain, or a star on the first
        delta, delta_s = timed_save(state, delta_path, codec=args.codec, base=base, max_chain=1 << 10)
        first = first or delta_path
        row = {"checkpoint": i, "full_bytes": full.stored_bytes, "full_save_s": full_s,
               "delta_bytes": delta.stored_bytes, "delta_save_s": delta_s, "delta_tensors": delta.delta_tensors,
               "full_groups": group_bytes(full_path), "delta_groups": group_bytes(delta_path)}
        rows.append(row)
        print(f"  K={interval} #{i}: full {full.stored_bytes / 2**20:8.1f} MiB {full_s:6.2f} s | delta "
              f"{delta.stored_bytes / 2**20:8.1f} MiB {delta_s:6.2f} s", flush=True)
        if previous is not None and i >= 2:
            (directory / f"full-{i - 1}.gdsckpt").unlink()
        previous = delta_path
    exact = same(gdsckpt.load(previous, device=DEVICE), state)
    full_total = sum(r["full_bytes"] for r in rows)
    delta_total = sum(r["delta_bytes"] for r in rows)
    weight_ratios = [r["delta_groups"]["model"][0] / r["delta_groups"]["model"][1] for r in rows[1:]]
    result = {"interval": interval, "rows": rows, "bit_exact": exact, "full_bytes": full_total,
              "delta_bytes": delta_total, "delta_share": delta_total / full_total,
              "bf16_weight_delta_ratio_median": sorted(weight_ratios)[len(weight_ratios) // 2] if weight_ratios else None,
              "full_save_s_median": sorted(r["full_save_s"] for r in rows)[len(rows) // 2],
              "delta_save_s_median": sorted(r["delta_save_s"] for r in rows[1:])[len(rows[1:]) // 2] if rows[1:] else None}
    for path in directory.glob("*.gdsckpt"):
        path.unlink()
    del model, optimizer
    if DEVICE.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def resume_loss(model: TinyGPT, optimizer: torch.optim.Optimizer, path: Path, snapshot: dict, steps: int) -> float:
    """Put the checkpoint at ``path`` into ``model`` / ``optimizer`` (master weights, moments;
    step counters from ``snapshot``), train ``steps`` steps on fixed batches, return the mean loss
    of the last 10."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = gdsckpt.load(path, device=DEVICE)
    names = {id(p): n for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(loaded["master"][name])
    for p, s in optimizer.state.items():
        for k in MOMENTS:
            s[k].copy_(loaded["optimizer"][names[id(p)]][k])
        s["step"].copy_(snapshot[names[id(p)]]) if torch.is_tensor(s["step"]) else s.__setitem__(
            "step", snapshot[names[id(p)]])
    losses = []
    for chunk in range(steps // 10):
        train_steps(model, optimizer, 10 - 1, seed=10_000 + chunk, batch=BATCH, length=LENGTH)
        losses.append(train_steps(model, optimizer, 1, seed=20_000 + chunk, batch=BATCH, length=LENGTH))
    tail = losses[-10:]
    return float(sum(float(x) for x in tail) / len(tail))


def lossy(args: argparse.Namespace, directory: Path) -> dict:
    model, optimizer = training(args.width, args.depth, args.warmup + 100)
    state = state_of(model, optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    steps = {names[id(p)]: (s["step"].clone() if torch.is_tensor(s["step"]) else s["step"])
             for p, s in optimizer.state.items()}
    result: dict = {"bounds": {}}
    lossless_path = directory / "lossless.gdsckpt"
    report, seconds = timed_save(state, lossless_path, codec=args.codec)
    groups = group_bytes(lossless_path)
    result["lossless"] = {"bytes": report.stored_bytes, "save_s": seconds,
                          "optimizer_ratio": groups["optimizer"][0] / groups["optimizer"][1]}
    result["lossless"]["resumed_loss"] = base_loss = resume_loss(model, optimizer, lossless_path, steps, args.resume)
    # Both moments, and exp_avg alone: a bound relative to the tensor's largest value rounds most
    # of exp_avg_sq's small entries to zero, which the next update m / (sqrt(v) + eps) amplifies.
    # Three policies: grid on both moments; grid on exp_avg only; grid on exp_avg and, per
    # element, mantissa rounding on exp_avg_sq (its entries keep rel of their own magnitude).
    policies = {"grid-both": lambda rel: {"*/exp_avg": rel, "*/exp_avg_sq": rel},
                "grid-exp_avg-only": lambda rel: {"*/exp_avg": rel},
                "grid+mantissa": lambda rel: {"*/exp_avg": rel, "*/exp_avg_sq": ("mantissa", rel)}}
    for rel, label in [(rel, label) for rel in args.lossy_bounds for label in policies]:
        policy = policies[label]
        name = f"{rel:g} {label}"
        path = directory / f"lossy-{rel:g}-{label}.gdsckpt"
        report, seconds = timed_save(state, path, codec=args.codec, lossy=policy(rel))
        groups = group_bytes(path)
        loss = resume_loss(model, optimizer, path, steps, args.resume)
        errors = [t.lossy for t in gdsckpt.inspect(path).tensors if t.lossy is not None]
        result["bounds"][name] = {
            "bytes": report.stored_bytes, "save_s": seconds, "lossy_arrays": len(errors),
            "optimizer_ratio": groups["optimizer"][0] / groups["optimizer"][1],
            "max_error_over_bound": max((e["max_error"] / e["abs_bound"] for e in errors), default=None),
            "resumed_loss": loss, "loss_change": (loss - base_loss) / base_loss}
        print(f"  lossy {name}: optimizer ratio {result['bounds'][name]['optimizer_ratio']:.2f}x, "
              f"resumed loss {loss:.4f} vs {base_loss:.4f}", flush=True)
    for path in directory.glob("*.gdsckpt"):
        path.unlink()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--intervals", default="10,100,1000")
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--count-1000", type=int, default=4, help="checkpoints at interval 1000 (time)")
    parser.add_argument("--codec", default="ans")
    parser.add_argument("--lossy-bounds", default="1e-2,1e-3")
    parser.add_argument("--resume", type=int, default=100)
    parser.add_argument("--skip", default="", help="parts to skip: deltas,lossy")
    parser.add_argument("--delta-base", choices=("previous", "full"), default="previous",
                        help="deltas on the previous checkpoint (a chain) or all on the first, full one (a star)")
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run)")
    parser.add_argument("--dir", type=Path, default=Path("/root/gdsckpt-delta-bench"))
    parser.add_argument("--out", type=Path, default=Path("delta-bench.json"))
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    args.lossy_bounds = [float(x) for x in args.lossy_bounds.split(",") if x]
    args.dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict = {"benchmark": "delta_bench", "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "gpu": torch.cuda.get_device_name(0) if DEVICE.startswith("cuda") else None, "torch": torch.__version__, "python": platform.python_version(),
                     "gdsckpt": gdsckpt.__version__, "width": args.width, "depth": args.depth, "codec": args.codec,
                     "count": args.count, "delta_base": args.delta_base, "deltas": {}, "errors": {}}
    skip = set(args.skip.split(","))
    if "deltas" not in skip:
        for interval in (int(x) for x in args.intervals.split(",") if x):
            try:
                results["deltas"][str(interval)] = deltas(args, interval, args.dir)
            except Exception:  # record, go on with the next part
                results["errors"][f"deltas_{interval}"] = traceback.format_exc()
                print(results["errors"][f"deltas_{interval}"], flush=True)
    if "lossy" not in skip:
        try:
            results["lossy"] = lossy(args, args.dir)
        except Exception:
            results["errors"]["lossy"] = traceback.format_exc()
            print(results["errors"]["lossy"], flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    d10, d100 = results["deltas"].get("10"), results["deltas"].get("100")
    bounds = results.get("lossy", {}).get("bounds", {})
    results["targets"] = {
        "bf16_weight_delta_at_10_ge_5x": d10 and {"value": d10["bf16_weight_delta_ratio_median"],
                                                  "met": (d10["bf16_weight_delta_ratio_median"] or 0) >= 5},
        "ten_at_100_le_40pct": d100 and {"value": d100["delta_share"], "met": d100["delta_share"] <= 0.40},
        "lossy_optimizer_ge_4x_loss_within_0.5pct": {
            rel: {"ratio": b["optimizer_ratio"], "loss_change": b["loss_change"],
                  "met": b["optimizer_ratio"] >= 4 and abs(b["loss_change"]) <= 0.005} for rel, b in bounds.items()},
    }
    results["seconds"] = time.perf_counter() - started
    args.out.write_text(json.dumps(results, indent=1, default=str))
    print(f"state {args.width}x{args.depth}, codec {args.codec}")
    print(f"  {'interval':>8} {'full MiB':>10} {'delta MiB':>10} {'share':>6} {'bf16 x':>7} {'full s':>7} "
          f"{'delta s':>7} exact")
    for interval, d in results["deltas"].items():
        print(f"  {interval:>8} {d['full_bytes'] / 2**20:10.1f} {d['delta_bytes'] / 2**20:10.1f} "
              f"{d['delta_share']:6.3f} {d['bf16_weight_delta_ratio_median'] or 0:7.2f} {d['full_save_s_median']:7.2f} "
              f"{d['delta_save_s_median'] or 0:7.2f} {d['bit_exact']}")
    if "lossy" in results:
        print(f"  lossless optimizer ratio {results['lossy']['lossless']['optimizer_ratio']:.2f}x")
        for rel, b in bounds.items():
            print(f"  lossy {rel:>6}: optimizer {b['optimizer_ratio']:.2f}x, loss change {b['loss_change']:+.4%}, "
                  f"max error / bound {b['max_error_over_bound']}")
    for name, target in results["targets"].items():
        print(f"target {name}: {target}")
    print(f"wrote {args.out} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
