"""Async-save benchmark: how long a training loop is blocked per checkpoint, and what checkpointing
in the background costs its throughput, one run.

One training state (``benchlib.build_training``: a ``gdsckpt.demo.TinyGPT`` trained
``--steps-before`` AdamW steps on random tokens; bf16 weights + fp32 master weights + exp_avg +
exp_avg_sq), two parts:

1. Blocked time. ``--rounds`` checkpoints of the same live state per method: ``torch.save`` (the
   whole call, fsync included), ``torch.distributed.checkpoint.async_save`` (the call returning its
   future; a new ``FileSystemWriter`` each time, and on CUDA one writer caching a pinned staged
   copy), ``CheckpointManager.save_async`` (the call returning its handle) per gdsckpt variant:
   the default ``Config``, ``snapshot_gpu_bytes`` large enough for a device-memory snapshot, each
   with ``async_worker="process"`` too, and any ``--variant``; ``prepare`` first. CUDA is
   synchronized before each timer starts; each round is waited for (with a timeout) outside the
   blocked time and its completion (call to durable) recorded; each gdsckpt variant's file is
   loaded back once and compared bit for bit. Medians.
2. Training throughput. ``--train-steps`` steps without checkpoints, then with a checkpoint every
   ``--every`` steps (``CheckpointManager.save_async`` of the live model + optimizer
   ``state_dict``; DCP ``async_save`` for comparison), then without again; steps/s of each against
   the mean of the two runs without. Each method is warmed up once before its timed loop.

``limits``: blocked time against 1/3 of DCP async_save's and 2% of torch.save's, throughput against
0.97 of the loop without checkpoints. A method that fails is recorded in ``errors`` and the others
go on; every wait has a timeout (``--timeout``).

    python3 benchmarks/async_bench.py --width 2560 --depth 8 --dir /root/async-bench --out async-bench.json
    python3 benchmarks/async_bench.py --training-only --variant preset:@async-training
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import faulthandler
import os
import re
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchlib
import torch

import gdsckpt

TIMEOUTS = ("TimeoutError",)
median = benchlib.median

# the limits each figure is reported next to
BLOCKED_VS_DCP = 1 / 3
BLOCKED_VS_TORCH_SAVE = 0.02
THROUGHPUT_RATIO = 0.97


def sync(device: Any) -> None:
    benchlib.sync(device.type)


def remove(path: Path) -> None:
    benchlib.remove(path)


def future_of(pending: Any) -> concurrent.futures.Future:
    """DCP's async_save returns a Future, or (with an async stager) an AsyncSaveResponse."""
    return getattr(pending, "upload_completion", pending)


def wait_future(pending: Any, timeout: float) -> None:
    future_of(pending).result(timeout=timeout)


# ---------------------------------------------------------------------------------------------
# part 1: blocked time per checkpoint

def blocked_rounds(rounds: int, device: Any, start: Callable[[int], Any],
                   finish: Callable[[Any], dict | None], cleanup: Callable[[int], None]) -> dict:
    """``start(round)`` is the timed call; ``finish(pending)`` waits for completion (untimed as
    blocked) and may return extra figures; ``cleanup(round)`` deletes the round's files."""
    out: dict[str, Any] = {"blocked_s": [], "blocked_until_gpu_idle_s": [], "completion_s": []}
    for index in range(rounds):
        sync(device)
        started = time.perf_counter()
        pending = start(index)
        returned = time.perf_counter()
        sync(device)  # any GPU work the call left queued would delay the next training step
        idle = time.perf_counter()
        extra = finish(pending) or {}
        done = time.perf_counter()
        cleanup(index)
        out["blocked_s"].append(returned - started)
        out["blocked_until_gpu_idle_s"].append(idle - started)
        out["completion_s"].append(done - started)
        for key, value in extra.items():
            out.setdefault(key, []).append(value)
    out["median_s"] = median(out["blocked_s"])
    out["completion_median_s"] = median(out["completion_s"])
    return out


def bench_blocked(state: dict, directory: Path, args: argparse.Namespace, device: Any,
                  configs: dict[str, Any], report: benchlib.Report) -> dict:
    import torch.distributed.checkpoint as dcp

    results: dict[str, Any] = {}
    timeout = args.timeout

    def path(method: str, index: int, suffix: str = "") -> Path:
        return directory / f"{method}-{index}{suffix}"

    def gdsckpt_method(name: str, config: Any) -> None:
        # A manager per variant: its own snapshot pool and worker, prepared before the first
        # checkpoint as a training loop would (buffers allocated, a worker process started).
        manager = gdsckpt.CheckpointManager(directory / name, keep_last=1, config=config)

        def finish(handle: gdsckpt.SaveHandle) -> dict:
            saved = handle.wait(timeout=timeout)
            if name not in report["checks"]:  # the state does not change between rounds
                report.check(name, benchlib.differences(state, gdsckpt.load(saved.path, device=device.type)))
            return {"snapshot_seconds": handle.snapshot_seconds, "snapshot_bytes": handle.snapshot_bytes,
                    "ratio": saved.ratio, "codec": saved.codec, "backend": saved.backend}

        started = time.perf_counter()
        manager.prepare(state)
        prepared = time.perf_counter() - started
        results[name] = blocked_rounds(args.rounds, device, lambda i: manager.save_async(i, state), finish,
                                       lambda i: None)
        results[name]["pool"] = dataclasses.asdict(manager.pool_stats())
        results[name]["prepare_s"] = prepared
        manager.wait(timeout=timeout)
        shutil.rmtree(directory / name, ignore_errors=True)

    for suffix, config in configs.items():
        name = f"gdsckpt_save_async{suffix}"
        report.attempt(name, gdsckpt_method, name, config)

    def dcp_default() -> None:
        results["dcp_async_save"] = blocked_rounds(
            args.rounds, device,
            lambda i: dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(path("dcp", i)))),
            lambda pending: wait_future(pending, timeout),
            lambda i: remove(path("dcp", i)))

    def dcp_pinned() -> None:
        # One writer for every round: it stages into a pinned copy it allocates once and reuses.
        writer = dcp.FileSystemWriter(str(path("dcp-pinned", 0)), cache_staged_state_dict=True)
        results["dcp_async_save_pinned"] = blocked_rounds(
            args.rounds, device,
            lambda i: dcp.async_save(state, checkpoint_id=str(path("dcp-pinned", i)), storage_writer=writer),
            lambda pending: wait_future(pending, timeout),
            lambda i: remove(path("dcp-pinned", i)))

    report.attempt("dcp_async_save", dcp_default)
    if device.type == "cuda":
        report.attempt("dcp_async_save_pinned", dcp_pinned)
    else:
        report["skipped"]["dcp_async_save_pinned"] = "pinned staging needs CUDA"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    report.attempt("torch_save", lambda: results.__setitem__("torch_save", blocked_rounds(
        args.rounds, device, lambda i: benchlib.durable_torch_save(state, path("torch", i, ".pt")),
        lambda _pending: None, lambda i: remove(path("torch", i, ".pt")))))
    return results


# ---------------------------------------------------------------------------------------------
# part 2: training throughput

def train_loop(model: Any, optimizer: Any, total: int, every: int, device: Any,
               checkpoint: Callable[[int], None] | None = None) -> dict:
    """``total`` steps in runs of ``every`` (``train_steps``), ``checkpoint(step)`` after each run."""
    blocked = []
    step = 0
    sync(device)
    started = time.perf_counter()
    while step < total:
        count = min(every, total - step)
        benchlib.train(model, optimizer, count, seed=1000 + step)
        step += count
        if checkpoint is not None and step % every == 0:
            call = time.perf_counter()
            checkpoint(step)
            blocked.append(time.perf_counter() - call)
    sync(device)
    seconds = time.perf_counter() - started
    return {"steps": total, "seconds": seconds, "steps_per_s": total / seconds, "checkpoints": len(blocked),
            "blocked_s": blocked, "blocked_median_s": median(blocked)}


def bench_training(model: Any, optimizer: Any, directory: Path,
                   args: argparse.Namespace, device: Any, configs: dict[str, Any], report: benchlib.Report
                   ) -> dict:
    import torch.distributed.checkpoint as dcp

    results: dict[str, Any] = {"every": args.every, "steps": args.train_steps}
    timeout = args.timeout

    def loop(checkpoint: Callable[[int], None] | None = None) -> dict:
        return train_loop(model, optimizer, args.train_steps, args.every, device, checkpoint)

    def with_manager(name: str, config: Any) -> None:
        where = directory / name
        manager = gdsckpt.CheckpointManager(where, keep_last=2, config=config)
        try:
            started = time.perf_counter()
            manager.save_async(0, benchlib.live_state(model, optimizer, 0)).wait(timeout=timeout)
            warmup = time.perf_counter() - started
            handles: list[gdsckpt.SaveHandle] = []
            run = loop(lambda step: handles.append(
                manager.save_async(step, benchlib.live_state(model, optimizer, step))))
            started = time.perf_counter()
            manager.wait(timeout=timeout)
            run["final_wait_s"] = time.perf_counter() - started
            run["warmup_checkpoint_s"] = warmup
            run["snapshot_seconds"] = [h.snapshot_seconds for h in handles]
            run["checkpoint_bytes"] = handles[0].snapshot_bytes if handles else None
            reports = [h.wait(timeout=timeout) for h in handles]
            run["save_seconds"] = [r.seconds for r in reports]
            run["ratio"] = reports[-1].ratio if reports else None
            run["steps_saved"] = manager.steps()
            results[name] = run
        finally:
            shutil.rmtree(where, ignore_errors=True)

    def with_dcp() -> None:
        where = directory / "dcp-train"
        paths: list[Path] = []
        pending: list[concurrent.futures.Future] = []

        def checkpoint(step: int) -> None:
            if pending:  # one save in flight at a time, as gdsckpt's max_inflight=1
                pending[-1].result(timeout=timeout)
            paths.append(where / f"step-{step:010d}")
            future = future_of(dcp.async_save(benchlib.live_state(model, optimizer, step),
                                              checkpoint_id=str(paths[-1])))
            if len(paths) > 2:  # keep_last=2: drop the oldest once this one is complete, in the background
                future.add_done_callback(lambda _f, old=paths[-3]: shutil.rmtree(old, ignore_errors=True))
            pending.append(future)

        try:
            started = time.perf_counter()
            checkpoint(0)
            pending.pop().result(timeout=timeout)
            warmup = time.perf_counter() - started
            shutil.rmtree(paths.pop(), ignore_errors=True)
            run = loop(checkpoint)
            started = time.perf_counter()
            for future in pending:
                future.result(timeout=timeout)
            run["final_wait_s"] = time.perf_counter() - started
            run["warmup_checkpoint_s"] = warmup
            results["dcp_async_save"] = run
        finally:
            shutil.rmtree(where, ignore_errors=True)

    report.attempt("train_none", lambda: results.__setitem__("none", loop()))
    for suffix, config in configs.items():
        name = f"gdsckpt_manager{suffix}"
        report.attempt(f"train_{name}", with_manager, name, config)
    report.attempt("train_dcp_async_save", with_dcp)
    report.attempt("train_none_again", lambda: results.__setitem__("none_again", loop()))
    baselines = [results[k]["steps_per_s"] for k in ("none", "none_again") if k in results]
    if baselines:
        results["baseline_steps_per_s"] = statistics.mean(baselines)
        for name, run in results.items():
            if isinstance(run, dict) and name not in ("none", "none_again"):
                run["ratio_to_baseline"] = run["steps_per_s"] / results["baseline_steps_per_s"]
    return results


# ---------------------------------------------------------------------------------------------
# targets and report

def compare(ours: dict[str, float], reference: float | None, limit: float, *, lower_is_better: bool) -> dict:
    """Each of ``ours`` (variant -> value) against ``reference`` and ``limit``; ``met``: the best
    variant meets it, ``met_default_config``: the default-config variant does."""
    variants = {}
    for name, value in ours.items():
        if reference is None or value is None:
            continue
        ratio = value / reference
        variants[name] = {"value": value, "ratio": ratio,
                          "met": ratio <= limit if lower_is_better else ratio >= limit}
    defaults = [v["met"] for k, v in variants.items() if "gpu_snapshot" not in k]
    return {"limit": limit, "reference": reference, "variants": variants,
            "met": any(v["met"] for v in variants.values()) if variants else None,
            "met_default_config": defaults[0] if defaults else None}


def targets(results: dict, device: str, logical: int) -> dict:
    blocked = results["blocked"]
    ours = {k: v["median_s"] for k, v in blocked.items() if k.startswith("gdsckpt")}
    dcp = blocked.get("dcp_async_save", {}).get("median_s")
    torch_save = blocked.get("torch_save", {}).get("median_s")
    out = {
        "blocked_le_one_third_of_dcp_async_save": {**compare(ours, dcp, BLOCKED_VS_DCP, lower_is_better=True),
                                                   "reference_method": "dcp_async_save"},
        "blocked_le_2pct_of_torch_save": {**compare(ours, torch_save, BLOCKED_VS_TORCH_SAVE, lower_is_better=True),
                                          "reference_method": "torch_save"},
    }
    pinned = blocked.get("dcp_async_save_pinned", {}).get("median_s")
    if pinned:
        out["blocked_vs_dcp_async_save_pinned"] = {k: v / pinned for k, v in ours.items() if v is not None}
    training = results["training"]
    steps = {k: v["steps_per_s"] for k, v in training.items() if isinstance(v, dict) and k.startswith("gdsckpt")}
    out["throughput_within_3pct_of_no_checkpoint"] = {
        **compare(steps, training.get("baseline_steps_per_s"), THROUGHPUT_RATIO, lower_is_better=False),
        "reference_method": "none (mean of the runs before and after)", "every": training["every"],
        "dcp_async_save_ratio": training.get("dcp_async_save", {}).get("ratio_to_baseline")}
    out["conditions"] = {"device_cuda": device == "cuda",
                         "state_ge_8GiB": logical >= 8 << 30, "every_is_100": training["every"] == 100}
    return out


def fmt(value: float | None, spec: str) -> str:
    width = int(re.match(r"\d*", spec).group() or 0)
    return f"{'-':>{width}}" if value is None else format(value, spec)


def print_table(report: benchlib.Report) -> None:
    results = report["results"]
    gib = report["state"].get("logical_bytes", 0) / 2**30
    print(f"state {gib:.2f} GiB on {report['device']} ({report['host']['gpu'] or 'no GPU'}), "
          f"{report['args']['rounds']} rounds, medians")
    print(f"  {'method':34}{'blocked s':>11}{'to GPU idle':>12}{'complete s':>12}{'snapshot s':>12}")
    for name, row in results.get("blocked", {}).items():
        print(f"  {name:34}{fmt(row['median_s'], '11.4f')}{fmt(median(row['blocked_until_gpu_idle_s']), '12.4f')}"
              f"{fmt(row['completion_median_s'], '12.3f')}{fmt(median(row.get('snapshot_seconds', [])), '12.4f')}")
    training = results.get("training", {})
    print(f"training: {training.get('steps')} steps, a checkpoint every {training.get('every')}")
    print(f"  {'method':34}{'steps/s':>11}{'ratio':>9}{'ckpts':>7}{'blocked s':>11}{'final wait s':>14}")
    for name, row in training.items():
        if isinstance(row, dict):
            print(f"  {name:34}{fmt(row['steps_per_s'], '11.3f')}{fmt(row.get('ratio_to_baseline'), '9.4f')}"
                  f"{row['checkpoints']:>7}{fmt(row['blocked_median_s'], '11.4f')}"
                  f"{fmt(row.get('final_wait_s'), '14.3f')}")
    for name, target in report["limits"].items():
        if isinstance(target, dict) and "variants" in target:
            ratios = ", ".join(f"{k} {v['ratio']:.4f}" for k, v in target["variants"].items())
            print(f"target {name} (limit {target['limit']:.4f}): met={target['met']} "
                  f"(default config: {target['met_default_config']}); {ratios}")


def configs_of(args: argparse.Namespace, report: benchlib.Report, logical: int) -> dict[str, Any]:
    """gdsckpt variants: "" the default Config (from the environment; only the timeout is ours),
    "_gpu_snapshot" a device-memory snapshot budget large enough for the whole state, "_process"
    the same with the save in a worker process, and each ``--variant``."""
    snapshot_bytes = args.snapshot_gpu_bytes or 2 * logical
    configs = {}
    for worker in args.workers:
        suffix = "" if worker == "thread" else f"_{worker}"
        base = gdsckpt.Config.from_env().replace(timeout=args.timeout)
        try:
            configs[suffix] = base if worker == "thread" else base.replace(async_worker=worker)
            configs[f"{suffix}_gpu_snapshot"] = configs[suffix].replace(snapshot_gpu_bytes=snapshot_bytes)
        except (TypeError, ValueError) as err:
            report["skipped"][f"gdsckpt{suffix}"] = f"Config does not take this variant: {err}"
    for spec in args.variant:
        name, _, fields = spec.partition(":")
        try:
            configs[f"_{name}"] = benchlib.config_variant(fields).replace(timeout=args.timeout)
        except (TypeError, ValueError, OSError) as err:
            report["skipped"][f"gdsckpt_{name}"] = f"variant {spec!r}: {err}"
    return configs


def run(args: argparse.Namespace, device: Any, directory: Path, report: benchlib.Report) -> None:
    built = report.attempt("build", benchlib.build_training, args.width, args.depth, args.steps_before, device.type)
    if built is None:
        return
    model, optimizer = built
    state = benchlib.mixed_precision_state(model, optimizer, copy=False)
    logical = benchlib.logical_bytes(state)
    report["state"] = benchlib.describe_state(state, width=args.width, depth=args.depth, steps=args.steps_before,
                                              train_checkpoint_bytes=benchlib.logical_bytes(
                                                  benchlib.live_state(model, optimizer, 0)))
    benchlib.warm_up(directory, device.type)
    configs = configs_of(args, report, logical)
    report["results"]["configs"] = {f"gdsckpt{s}": benchlib.config_dict(c) for s, c in configs.items()}
    if args.training_only:
        report["results"]["blocked"] = {}
        report["skipped"]["blocked"] = "--training-only"
    else:
        report["results"]["blocked"] = bench_blocked(state, directory, args, device, configs, report)
    del state  # the bf16 copies; the training loop checkpoints model + optimizer state_dicts
    if device.type == "cuda":
        torch.cuda.empty_cache()
    report["results"]["training"] = bench_training(model, optimizer, directory, args, device, configs, report)
    report["limits"] = targets(report["results"], device.type, logical)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--width", type=int, default=2560, help="2560 x depth 8: an 8.76 GiB state")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps-before", type=int, default=50, help="training steps before the benchmark")
    parser.add_argument("--dir", default="/tmp/gdsckpt-async-bench")
    parser.add_argument("--out", default="async-bench.json")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if benchlib.cuda_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3, help="checkpoints per method (blocked time)")
    parser.add_argument("--every", type=int, default=100, help="checkpoint every K training steps")
    parser.add_argument("--train-steps", type=int, default=300, help="steps per timed training loop")
    parser.add_argument("--snapshot-gpu-bytes", type=int, default=0,
                        help="Config.snapshot_gpu_bytes of the device-snapshot variants (0: twice the state)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any single wait may take")
    parser.add_argument("--workers", default="thread,process",
                        help="Config.async_worker values of the gdsckpt variants (thread: in the training process)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE[,FIELD=VALUE]",
                        help="an extra gdsckpt variant _NAME: the default Config with these fields (written as "
                        "their GDSCKPT_* variables take them), or NAME:@FILE.toml (repeatable)")
    parser.add_argument("--training-only", action="store_true", help="leave out part 1 (blocked time)")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck run shows where it is
    args.workers = [w for w in args.workers.split(",") if w]
    device = torch.device(args.device)
    report_of: list[benchlib.Report] = []

    def whole(report: benchlib.Report, directory: Path) -> None:
        report_of.append(report)
        run(args, device, directory, report)

    status = benchlib.run_benchmark("async_bench", args, whole, print_table)
    report = report_of[0] if report_of else None
    if report is None:
        return status
    if any(error.startswith(TIMEOUTS) for error in report["errors"].values()):
        # a save may still be running: do not wait for it at interpreter exit
        print("a wait timed out; exiting without waiting for background saves", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    return 2 if "run" in report["errors"] else status


if __name__ == "__main__":
    sys.exit(main())
