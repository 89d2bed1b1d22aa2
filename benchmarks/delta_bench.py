"""Delta and lossy checkpoints: bytes and save time of deltas, ratio and resumed loss of lossy saves.

1. Deltas. For each interval K in ``--intervals``: a TinyGPT (``benchlib.build_training``; its
   state bf16 weights + fp32 master weights + AdamW exp_avg / exp_avg_sq) trains ``--warmup`` steps,
   then ``--count`` checkpoints are taken every K steps, each saved twice on the same data: in
   full, and as a delta against the previous delta-run checkpoint (the first one full, as a
   ``CheckpointManager`` with ``delta_every`` would). Bytes and durable save seconds of both;
   the last delta is loaded back and compared bit for bit. ``--delta-base full`` bases every
   delta on the first checkpoint (a star, as ``CheckpointManager(delta_base="full")``) instead.
   Limits: bf16-weight delta at K=10 >= 5x; the ``--count`` checkpoints at K=100 in <= 40% of the
   bytes of the full ones.
2. Lossy. The trained state is saved losslessly and with ``lossy={"*exp_avg": r, "*exp_avg_sq": r}``
   for each r in ``--lossy-bounds``; ratio of the Adam moments. Then training resumes ``--resume``
   steps from each (moments loaded from the file, the same batches) and the mean loss of the last
   10 steps is compared with resuming from the lossless one; each lossy array's recorded error
   is checked against its bound.
   Limits: lossy optimizer state >= 4x; resumed loss within 0.5% of lossless.

Writes JSON (benchlib's schema; the limits under ``limits``) and prints a table.

    python3 benchmarks/delta_bench.py --width 1024 --depth 4 --dir /root/delta-bench --out delta-bench.json
    python3 benchmarks/delta_bench.py --device cpu --width 256 --depth 2 --codec zstd --delta-base full
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import benchlib
import torch

import gdsckpt

MOMENTS = benchlib.MOMENTS
DEVICE = "cuda"


def sync() -> None:
    benchlib.sync(DEVICE)


def training(width: int, depth: int, warmup: int) -> tuple[Any, Any]:
    return benchlib.build_training(width, depth, warmup, DEVICE)


def state_of(model: Any, optimizer: Any) -> dict:
    """A copy of the training state (bf16 weights, fp32 master weights, moments)."""
    state = benchlib.mixed_precision_state(model, optimizer)
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


def deltas(args: argparse.Namespace, interval: int, directory: Path) -> dict:
    model, optimizer = training(args.width, args.depth, args.warmup)
    rows, previous, first = [], None, None
    for i in range(args.count if interval < 1000 else args.count_1000):
        benchlib.train(model, optimizer, interval, seed=1 + i)
        state = state_of(model, optimizer)
        full_path, delta_path = directory / f"full-{i}.gdsckpt", directory / f"delta-{i}.gdsckpt"
        full, full_s = timed_save(state, full_path, codec=args.codec)
        base = previous if args.delta_base == "previous" else first  # a chain, or a star on the first
        delta, delta_s = timed_save(state, delta_path, codec=args.codec, base=base, max_chain=1 << 10)
        first = first or delta_path
        row = {"checkpoint": i, "full_bytes": full.file_bytes, "full_save_s": full_s,
               "delta_bytes": delta.file_bytes, "delta_save_s": delta_s, "delta_tensors": delta.delta_tensors,
               "full_groups": group_bytes(full_path), "delta_groups": group_bytes(delta_path)}
        rows.append(row)
        print(f"  K={interval} #{i}: full {full.file_bytes / 2**20:8.1f} MiB {full_s:6.2f} s | delta "
              f"{delta.file_bytes / 2**20:8.1f} MiB {delta_s:6.2f} s", flush=True)
        if previous is not None and i >= 2:
            (directory / f"full-{i - 1}.gdsckpt").unlink()
        previous = delta_path
    problems = benchlib.differences(state, gdsckpt.load(previous, device=DEVICE))
    full_total = sum(r["full_bytes"] for r in rows)
    delta_total = sum(r["delta_bytes"] for r in rows)
    weight_ratios = [r["delta_groups"]["model"][0] / r["delta_groups"]["model"][1] for r in rows[1:]]
    delta_saves = sorted(r["delta_save_s"] for r in rows[1:])
    weight_median = sorted(weight_ratios)[len(weight_ratios) // 2] if weight_ratios else None
    result = {"interval": interval, "rows": rows, "bit_exact": not problems, "problems": problems[:5],
              "full_bytes": full_total, "delta_bytes": delta_total, "delta_share": delta_total / full_total,
              "bf16_weight_delta_ratio_median": weight_median,
              "full_save_s_median": sorted(r["full_save_s"] for r in rows)[len(rows) // 2],
              "delta_save_s_median": delta_saves[len(delta_saves) // 2] if delta_saves else None}
    for path in directory.glob("*.gdsckpt"):
        path.unlink()
    del model, optimizer
    if DEVICE.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def resume_loss(model: Any, optimizer: Any, path: Path, snapshot: dict, steps: int) -> float:
    """Put the checkpoint at ``path`` into ``model`` / ``optimizer`` (master weights, moments;
    step counters from ``snapshot``), train ``steps`` steps on fixed batches, return the mean loss
    of the last 10."""
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
        benchlib.train(model, optimizer, 10 - 1, seed=10_000 + chunk)
        losses.append(benchlib.train(model, optimizer, 1, seed=20_000 + chunk))
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
    result["lossless"] = {"bytes": report.file_bytes, "save_s": seconds,
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
            "bytes": report.file_bytes, "save_s": seconds, "lossy_arrays": len(errors),
            "optimizer_ratio": groups["optimizer"][0] / groups["optimizer"][1],
            "max_error_over_bound": max((e["max_error"] / e["abs_bound"] for e in errors), default=None),
            "resumed_loss": loss, "loss_change": (loss - base_loss) / base_loss}
        print(f"  lossy {name}: optimizer ratio {result['bounds'][name]['optimizer_ratio']:.2f}x, "
              f"resumed loss {loss:.4f} vs {base_loss:.4f}", flush=True)
    for path in directory.glob("*.gdsckpt"):
        path.unlink()
    return result


def limits(results: dict) -> dict:
    d10, d100 = results.get("deltas", {}).get("10"), results.get("deltas", {}).get("100")
    bounds = results.get("lossy", {}).get("bounds", {})
    return {
        "bf16_weight_delta_at_10_ge_5x": d10 and {"value": d10["bf16_weight_delta_ratio_median"],
                                                  "met": (d10["bf16_weight_delta_ratio_median"] or 0) >= 5},
        "ten_at_100_le_40pct": d100 and {"value": d100["delta_share"], "met": d100["delta_share"] <= 0.40},
        "lossy_optimizer_ge_4x_loss_within_0.5pct": {
            rel: {"ratio": b["optimizer_ratio"], "loss_change": b["loss_change"],
                  "met": b["optimizer_ratio"] >= 4 and abs(b["loss_change"]) <= 0.005} for rel, b in bounds.items()},
    }


def run(args: argparse.Namespace, report: benchlib.Report, directory: Path) -> None:
    results: dict = {"deltas": {}}
    report["results"] = results
    model, optimizer = training(args.width, args.depth, 0)
    report["state"] = benchlib.describe_state(state_of(model, optimizer), width=args.width, depth=args.depth,
                                              warmup=args.warmup)
    del model, optimizer
    skip = set(args.skip.split(","))
    if "deltas" not in skip:
        for interval in (int(x) for x in args.intervals.split(",") if x):
            row = report.attempt(f"deltas_{interval}", deltas, args, interval, directory)
            if row is not None:
                results["deltas"][str(interval)] = row
                report.check(f"deltas_{interval}", row["problems"])
    if "lossy" not in skip:
        lossy_results = report.attempt("lossy", lossy, args, directory)
        if lossy_results is not None:
            results["lossy"] = lossy_results
            for name, row in lossy_results["bounds"].items():
                within = row["max_error_over_bound"] is not None and row["max_error_over_bound"] <= 1
                report.check(f"lossy {name} within its bound", [] if within else [f"max error / bound {row}"])
    report["limits"] = limits(results)


def print_table(report: benchlib.Report) -> None:
    results, args = report["results"], report["args"]
    print(f"state {args['width']}x{args['depth']}, codec {args['codec']}")
    print(f"  {'interval':>8} {'full MiB':>10} {'delta MiB':>10} {'share':>6} {'bf16 x':>7} {'full s':>7} "
          f"{'delta s':>7} exact")
    for interval, d in results.get("deltas", {}).items():
        print(f"  {interval:>8} {d['full_bytes'] / 2**20:10.1f} {d['delta_bytes'] / 2**20:10.1f} "
              f"{d['delta_share']:6.3f} {d['bf16_weight_delta_ratio_median'] or 0:7.2f} {d['full_save_s_median']:7.2f} "
              f"{d['delta_save_s_median'] or 0:7.2f} {d['bit_exact']}")
    if "lossy" in results:
        print(f"  lossless optimizer ratio {results['lossy']['lossless']['optimizer_ratio']:.2f}x")
        for rel, b in results["lossy"]["bounds"].items():
            print(f"  lossy {rel:>6}: optimizer {b['optimizer_ratio']:.2f}x, loss change {b['loss_change']:+.4%}, "
                  f"max error / bound {b['max_error_over_bound']}")
    for name, target in report["limits"].items():
        print(f"limit {name}: {target}")


def main() -> int:
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
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if benchlib.cuda_available() else "cpu")
    parser.add_argument("--dir", default="/tmp/gdsckpt-delta-bench")
    parser.add_argument("--out", default="delta-bench.json")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    args.lossy_bounds = [float(x) for x in args.lossy_bounds.split(",") if x]
    return benchlib.run_benchmark("delta_bench", args, lambda report, directory: run(args, report, directory),
                                  print_table)


if __name__ == "__main__":
    sys.exit(main())
