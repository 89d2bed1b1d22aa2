"""Async-save benchmark (issue 4): how long a training loop is blocked per checkpoint, one run.

Two parts, on one training state built as benchmarks/gpu_bench.py builds it (a gdsckpt.demo.TinyGPT
trained ``--steps-before`` AdamW steps on random tokens; bf16 weights + fp32 master weights +
exp_avg + exp_avg_sq):

1. Blocked time. ``--rounds`` checkpoints of the same live state per method: ``torch.save`` (the
   whole call, fsync of the file included), ``torch.distributed.checkpoint.async_save`` (the call
   returning its future; with a new ``FileSystemWriter`` each time, and with one writer that caches
   its staged copy in pinned memory), ``gdsckpt.save_async`` (the call returning its handle; default
   ``Config`` and ``Config(snapshot_gpu_bytes=...)``, a device-memory snapshot; each also with
   ``async_worker="process"``, the save in a worker process; ``prepare`` first). CUDA is
   synchronized before each timer starts; each round is waited for (with a timeout) outside the
   blocked time, and its completion time (call to durable on disk) is recorded too. Medians.
2. Training throughput. ``--train-steps`` steps of ``gdsckpt.demo.train_steps`` without
   checkpoints, then with a checkpoint every ``--every`` steps (``CheckpointManager.save_async``
   of the live model + optimizer ``state_dict``; DCP ``async_save`` for comparison), then without
   again; steps/s of each against the mean of the two runs without. Each method's checkpointing is
   warmed up once (snapshot buffers allocated) before its timed loop.

A method that fails is recorded in ``errors`` and the others go on; every wait has a timeout
(``--timeout``). Writes JSON (host, date, versions, every figure, ``targets``) and prints a table.

    python3 benchmarks/async_bench.py --width 2560 --depth 8 --dir /root/gdsckpt-async-bench \\
        --out async-bench.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import faulthandler
import json
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from gpu_bench import tensors  # benchmarks/ is on sys.path when this runs as a script

import gdsckpt
from gdsckpt.config import _coerce
from gdsckpt.demo import TinyGPT, _durable_torch_save, train_steps

TIMEOUTS = (TimeoutError, concurrent.futures.TimeoutError)
BATCH, LENGTH, VOCAB, HEADS = 4, 128, 8192, 16  # as benchmarks/gpu_bench.py

# targets of issue 4
BLOCKED_VS_DCP = 1 / 3
BLOCKED_VS_TORCH_SAVE = 0.02
THROUGHPUT_RATIO = 0.97


# ---------------------------------------------------------------------------------------------
# state

def build_training(width: int, depth: int, steps: int, device: torch.device
                   ) -> tuple[TinyGPT, torch.optim.Optimizer]:
    """The model and AdamW optimizer of benchmarks/gpu_bench.py after ``steps`` steps."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, width=width, depth=depth, heads=HEADS, context=LENGTH).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_steps(model, optimizer, steps, seed=0, batch=BATCH, length=LENGTH)
    sync(device)
    return model, optimizer


def mixed_precision_state(model: TinyGPT, optimizer: torch.optim.Optimizer) -> dict:
    """gpu_bench.py's state layout, on the live tensors: bf16 weights (copies), fp32 master weights
    (the parameters themselves), exp_avg and exp_avg_sq."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {"model": {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()},
            "master": {n: p.detach() for n, p in model.named_parameters()},
            "optimizer": {names[id(p)]: {k: v for k, v in s.items() if k != "step"}
                          for p, s in optimizer.state.items()}}


def live_state(model: TinyGPT, optimizer: torch.optim.Optimizer, step: int) -> dict:
    """What a training loop checkpoints (README): the model's and optimizer's state_dict."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(state) if isinstance(t, torch.Tensor))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class Recorder:
    """Runs each method with ``attempt``: a failure goes to ``errors`` (method -> message) and the
    others go on; after each method the JSON so far is written to ``out`` (a run cut short by an
    outer time limit keeps what it measured) and a progress line is printed."""

    def __init__(self, results: dict, out: Path, skip: frozenset[str] = frozenset()):
        self.results, self.out, self.skip = results, out, skip
        self.errors: dict[str, str] = results.setdefault("errors", {})
        self.seconds: dict[str, float] = results.setdefault("phase_seconds", {})
        self.timed_out = False
        self.started = time.perf_counter()

    def attempt(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        if name in self.skip:
            self.results.setdefault("skipped", {})[name] = "--skip"
            return None
        started = time.perf_counter()
        try:
            return fn(*args)
        except Exception as err:  # noqa: BLE001 - one method failing must not lose the others
            frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
            where = f" (at {Path(frame.filename).name}:{frame.lineno})" if frame else ""
            self.errors[name] = f"{type(err).__name__}: {err}{where}"
            self.timed_out |= isinstance(err, TIMEOUTS)
            return None
        finally:
            self.seconds[name] = time.perf_counter() - started
            status = "failed" if name in self.errors else "done"
            print(f"[{time.perf_counter() - self.started:7.1f} s] {name} {status} "
                  f"({self.seconds[name]:.1f} s)", flush=True)
            self.write()

    def write(self) -> None:
        self.out.write_text(json.dumps(self.results, indent=1, default=str))


def future_of(pending: Any) -> concurrent.futures.Future:
    """DCP's async_save returns a Future, or (with an async stager) an AsyncSaveResponse."""
    return getattr(pending, "upload_completion", pending)


def wait_future(pending: Any, timeout: float) -> None:
    future_of(pending).result(timeout=timeout)


# ---------------------------------------------------------------------------------------------
# part 1: blocked time per checkpoint

def blocked_rounds(rounds: int, device: torch.device, start: Callable[[int], Any],
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


def bench_blocked(state: dict, directory: Path, args: argparse.Namespace, device: torch.device,
                  configs: dict[str, Any], recorder: Recorder, skipped: dict) -> dict:
    import torch.distributed.checkpoint as dcp

    results: dict[str, Any] = {}
    timeout = args.timeout

    def path(method: str, index: int, suffix: str = "") -> Path:
        return directory / f"{method}-{index}{suffix}"

    def gdsckpt_method(name: str, config: Any) -> None:
        def finish(handle: gdsckpt.SaveHandle) -> dict:
            report = handle.wait(timeout=timeout)
            return {"snapshot_seconds": handle.snapshot_seconds, "snapshot_bytes": handle.snapshot_bytes,
                    "ratio": report.ratio, "codec": report.codec, "backend": report.backend}

        try:
            started = time.perf_counter()
            # As a training loop would (the docs say so): buffers allocated and, with
            # async_worker="process", the worker started before the first checkpoint.
            gdsckpt.async_save.prepare(state, config=config)
            prepared = time.perf_counter() - started
            results[name] = blocked_rounds(
                args.rounds, device,
                lambda i: gdsckpt.save_async(state, path(name, i, ".gdsckpt"), config=config),
                finish, lambda i: remove(path(name, i, ".gdsckpt")))
            results[name]["pool"] = dataclasses.asdict(gdsckpt.async_save.pool_stats())
            results[name]["prepare_s"] = prepared
        finally:
            gdsckpt.async_save.clear_pool()
            gdsckpt.async_save._default_saver.close_worker()

    for suffix, config in configs.items():
        name = f"gdsckpt_save_async{suffix}"
        recorder.attempt(name, gdsckpt_method, name, config)

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

    recorder.attempt("dcp_async_save", dcp_default)
    if device.type == "cuda":
        recorder.attempt("dcp_async_save_pinned", dcp_pinned)
    else:
        skipped["dcp_async_save_pinned"] = "pinned staging needs CUDA"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    recorder.attempt("torch_save", lambda: results.__setitem__("torch_save", blocked_rounds(
        args.rounds, device, lambda i: _durable_torch_save(state, path("torch", i, ".pt")),
        lambda _pending: None, lambda i: remove(path("torch", i, ".pt")))))
    return results


# ---------------------------------------------------------------------------------------------
# part 2: training throughput

def train_loop(model: TinyGPT, optimizer: torch.optim.Optimizer, total: int, every: int, device: torch.device,
               checkpoint: Callable[[int], None] | None = None) -> dict:
    """``total`` steps in runs of ``every`` (``train_steps``), ``checkpoint(step)`` after each run."""
    blocked = []
    step = 0
    sync(device)
    started = time.perf_counter()
    while step < total:
        count = min(every, total - step)
        train_steps(model, optimizer, count, seed=1000 + step, batch=BATCH, length=LENGTH)
        step += count
        if checkpoint is not None and step % every == 0:
            call = time.perf_counter()
            checkpoint(step)
            blocked.append(time.perf_counter() - call)
    sync(device)
    seconds = time.perf_counter() - started
    return {"steps": total, "seconds": seconds, "steps_per_s": total / seconds, "checkpoints": len(blocked),
            "blocked_s": blocked, "blocked_median_s": median(blocked)}


def bench_training(model: TinyGPT, optimizer: torch.optim.Optimizer, directory: Path,
                   args: argparse.Namespace, device: torch.device, configs: dict[str, Any], recorder: Recorder
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
            manager.save_async(0, live_state(model, optimizer, 0)).wait(timeout=timeout)
            warmup = time.perf_counter() - started
            handles: list[gdsckpt.SaveHandle] = []
            run = loop(lambda step: handles.append(manager.save_async(step, live_state(model, optimizer, step))))
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
            manager._saver.close_worker()
            shutil.rmtree(where, ignore_errors=True)

    def with_dcp() -> None:
        where = directory / "dcp-train"
        paths: list[Path] = []
        pending: list[concurrent.futures.Future] = []

        def checkpoint(step: int) -> None:
            if pending:  # one save in flight at a time, as gdsckpt's max_inflight=1
                pending[-1].result(timeout=timeout)
            paths.append(where / f"step-{step:010d}")
            future = future_of(dcp.async_save(live_state(model, optimizer, step), checkpoint_id=str(paths[-1])))
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

    recorder.attempt("train_none", lambda: results.__setitem__("none", loop()))
    for suffix, config in configs.items():
        name = f"gdsckpt_manager{suffix}"
        recorder.attempt(f"train_{name}", with_manager, name, config)
    recorder.attempt("train_dcp_async_save", with_dcp)
    recorder.attempt("train_none_again", lambda: results.__setitem__("none_again", loop()))
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


def targets(results: dict) -> dict:
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
    out["conditions"] = {"device_cuda": results["device"] == "cuda",
                         "state_ge_8GiB": results["logical_bytes"] >= 8 << 30, "every_is_100": training["every"] == 100}
    return out


def fmt(value: float | None, spec: str) -> str:
    width = int(re.match(r"\d*", spec).group() or 0)
    return f"{'-':>{width}}" if value is None else format(value, spec)


def print_table(results: dict) -> None:
    gib = results.get("logical_bytes", 0) / 2**30
    print(f"state {gib:.2f} GiB on {results['device']} ({results['gpu'] or 'no GPU'}), "
          f"{results['rounds']} rounds, medians")
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
    for name, target in results.get("targets", {}).items():
        if isinstance(target, dict) and "variants" in target:
            ratios = ", ".join(f"{k} {v['ratio']:.4f}" for k, v in target["variants"].items())
            print(f"target {name} (limit {target['limit']:.4f}): met={target['met']} "
                  f"(default config: {target['met_default_config']}); {ratios}")
    for name, reason in results["skipped"].items():
        print(f"skipped {name}: {reason}")
    for name, error in results["errors"].items():
        print(f"error {name}: {error[:300]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2560, help="2560 x depth 8: the 8.76 GiB state of issue 4")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps-before", type=int, default=50, help="training steps before the benchmark")
    parser.add_argument("--dir", default="/tmp/gdsckpt-async-bench")
    parser.add_argument("--out", default="async-bench.json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3, help="checkpoints per method (blocked time)")
    parser.add_argument("--every", type=int, default=100, help="checkpoint every K training steps")
    parser.add_argument("--train-steps", type=int, default=300, help="steps per timed training loop")
    parser.add_argument("--snapshot-gpu-bytes", type=int, default=0,
                        help="Config.snapshot_gpu_bytes of the device-snapshot variants (0: twice the state)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any single wait may take")
    parser.add_argument("--workers", default="thread,process",
                        help="Config.async_worker values of the gdsckpt variants (thread: in the training process)")
    parser.add_argument("--skip", default="", help="phases to leave out, as named in the progress lines "
                        "(e.g. dcp_async_save_pinned,train_gdsckpt_manager_gpu_snapshot)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE[,FIELD=VALUE]",
                        help="an extra gdsckpt variant ``_NAME``: the default Config with these fields, "
                        "written as their GDSCKPT_* environment variables take them, or NAME:@FILE.toml, "
                        "a config file (repeatable; e.g. cpu_process:engine=cpu,async_worker=process or "
                        "preset:@configs/async-training.toml)")
    parser.add_argument("--training-only", action="store_true",
                        help="leave out part 1 (blocked time of single checkpoints)")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck run shows where it is
    args.workers = [w for w in args.workers.split(",") if w]
    device = torch.device(args.device)
    created = not Path(args.dir).exists()
    directory = Path(args.dir) / f"run-{os.getpid()}"
    directory.mkdir(parents=True)
    results: dict[str, Any] = {
        "benchmark": "async_bench", "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": device.type, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "python": platform.python_version(), "torch": torch.__version__, "gdsckpt": gdsckpt.__version__,
        "cpu_count": os.cpu_count(), "width": args.width, "depth": args.depth, "steps_before": args.steps_before,
        "rounds": args.rounds, "every": args.every, "train_steps": args.train_steps, "timeout": args.timeout,
        "errors": {}, "skipped": {}}
    recorder = Recorder(results, Path(args.out), frozenset(x for x in args.skip.split(",") if x))
    try:
        with warnings.catch_warnings():
            # DCP without a process group warns "torch.distributed is disabled, unavailable or
            # uninitialized, assuming the intent is to save in a single process": that is the intent.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            recorder.attempt("run", lambda: run(args, device, directory, results, recorder))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        if created:
            try:
                Path(args.dir).rmdir()
            except OSError:
                pass
    recorder.write()
    print_table(results)
    print(f"wrote {args.out}", flush=True)
    if recorder.timed_out:  # a save may still be running: do not wait for it at interpreter exit
        print("a wait timed out; exiting without waiting for background saves", flush=True)
        sys.stderr.flush()
        os._exit(3)
    if "run" in results["errors"]:
        sys.exit(2)


def run(args: argparse.Namespace, device: torch.device, directory: Path, results: dict, recorder: Recorder) -> None:
    skipped = results["skipped"]
    built = recorder.attempt("build", lambda: build_training(args.width, args.depth, args.steps_before, device))
    if built is None:
        raise RuntimeError("could not build the training state (errors['build'])")
    model, optimizer = built
    state = mixed_precision_state(model, optimizer)
    results["logical_bytes"] = nbytes(state)
    results["train_checkpoint_bytes"] = nbytes(live_state(model, optimizer, 0))
    if device.type == "cuda":
        from gdsckpt.pipeline.autotune import storage_gbps

        # cached before timing, as in steady use (gdsckpt's codec="auto" on the GPU reads it)
        results["storage_gbps_probe"] = recorder.attempt("storage_gbps", lambda: storage_gbps(directory))
    snapshot_bytes = args.snapshot_gpu_bytes or 2 * results["logical_bytes"]
    results["snapshot_gpu_bytes"] = snapshot_bytes
    # gdsckpt variants: "" the default Config (from the environment; only the timeout is ours),
    # "_gpu_snapshot" a device-memory snapshot budget large enough for the whole state
    # "_process": the same with async_worker="process" (the save in a worker process)
    configs = {}
    for worker in args.workers:
        suffix = "" if worker == "thread" else f"_{worker}"
        base = gdsckpt.Config.from_env().replace(timeout=args.timeout)
        try:
            configs[suffix] = base if worker == "thread" else base.replace(async_worker=worker)
            configs[f"{suffix}_gpu_snapshot"] = configs[suffix].replace(snapshot_gpu_bytes=snapshot_bytes)
        except (TypeError, ValueError) as err:  # a gdsckpt without the field yet
            skipped[f"gdsckpt{suffix}"] = f"Config does not take this variant: {err}"
    for spec in args.variant:
        name, _, fields = spec.partition(":")
        base = gdsckpt.Config.from_env().replace(timeout=args.timeout)
        try:
            if fields.startswith("@"):  # a config file (a preset), applied over the environment
                configs[f"_{name}"] = gdsckpt.Config.from_toml(fields[1:]).replace(timeout=args.timeout)
                continue
            changes = dict(field.split("=", 1) for field in fields.split(",") if field)
            configs[f"_{name}"] = base.replace(**{k: _coerce(k, v) for k, v in changes.items()})
        except (TypeError, ValueError) as err:
            skipped[f"gdsckpt_{name}"] = f"variant {spec!r}: {err}"
    results["configs"] = {f"gdsckpt{suffix}": dataclasses.asdict(c) for suffix, c in configs.items()}
    if args.training_only:
        results["blocked"] = {}
        skipped["blocked"] = "--training-only"
    else:
        results["blocked"] = bench_blocked(state, directory, args, device, configs, recorder, skipped)
    del state  # the bf16 copies; the training loop checkpoints model + optimizer state_dicts
    if device.type == "cuda":
        torch.cuda.empty_cache()
    results["training"] = bench_training(model, optimizer, directory, args, device, configs, recorder)
    results["targets"] = targets(results)


if __name__ == "__main__":
    main()
