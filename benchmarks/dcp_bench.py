"""DCP benchmark: torch.distributed.checkpoint save / load through gdsckpt's storage layer
(``GdsStorageWriter`` / ``GdsStorageReader``) against DCP's own ``FileSystemWriter`` /
``FileSystemReader``, plain and with DCP's zstd extension, on one training state.

The state is ``benchlib.build_state`` (a ``gdsckpt.demo.TinyGPT`` trained ``--steps`` AdamW
steps; bf16 weights + fp32 master weights + exp_avg + exp_avg_sq) on ``--device``, flattened to
one dict with keys joined by "." (DCP's own separator), so the logical bytes are the same for all:

- ``gdsckpt_dcp[<codec>]``: ``dcp.save`` with ``GdsStorageWriter(codec=<codec>)`` (one per
  ``--codecs`` entry), ``dcp.load`` with ``GdsStorageReader``,
- ``dcp_fs`` / ``dcp_fs_zstd``: ``dcp.save`` with ``FileSystemWriter(sync_files=True)``,
  without / with ``_extensions=[ZStandard()]``), ``dcp.load`` with ``FileSystemReader``.

Writes are durable (the writers fsync inside the timing: ``sync_files=True``; gdsckpt fsyncs
file and directory); reads are cold (every file of the checkpoint is fsynced and dropped from
the page cache with posix_fadvise(DONTNEED) before the load). Every load
goes into fresh zero tensors on the state's device and is compared bit for bit with the source.
GB/s is logical tensor bytes (10**9) over wall seconds; ratio is logical bytes over the bytes of
every file of the checkpoint directory.

First in this process, without a process group; then, for each ``--ranks`` entry N, on N
spawned ranks (NCCL, rank r on cuda:r; gloo on the CPU) holding the same state sharded
``Shard(0)`` as DTensors: the aggregate GB/s is the global logical bytes over rank 0's time from
the barrier before to the barrier after. N above the GPU count is recorded as skipped. One
method's failure is recorded in ``errors`` and the run goes on. ``limits``: each gdsckpt layer's
speeds as multiples of DCP's FileSystemWriter/Reader in the same run. JSON (benchlib's schema)
goes to ``--out``; a short table is printed last.

    python3 benchmarks/dcp_bench.py --width 2560 --depth 8 --dir /root/dcp-bench --out dcp.json --ranks 1,2
    python3 benchmarks/dcp_bench.py --device cpu --width 64 --depth 1 --steps 1 --out dcp.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchlib
import torch
import torch.distributed.checkpoint as dcp

from gdsckpt.dcp import GdsStorageReader, GdsStorageWriter

PG_TIMEOUT = datetime.timedelta(seconds=120)


# ---------------------------------------------------------------------------------------------
# state, timing, files

def dotted(state: dict[str, Any]) -> dict[str, Any]:
    """The state as one flat dict with DCP's own separator, ``model.blocks.0.qkv.weight``."""
    return benchlib.flatten(state, sep=".")[0]


def build_state(width: int, depth: int, steps: int, device: str) -> dict[str, Any]:
    return dotted(benchlib.build_state(width, depth, steps, device))


def logical_bytes(flat: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in flat.values())


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def release_gpu_memory() -> None:
    """Hand cached blocks back (torch's and CuPy's, which the GPU engine allocates from), so that
    ranks spawned next on the same GPU find its memory free."""
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()


def stored_codecs(path: Path) -> list[dict[str, Any]]:
    """The codec chains of each gdsckpt file a checkpoint directory holds (one per rank file), so
    the JSON says which engine wrote: nvcomp chains come from the GPU engine."""
    import gdsckpt

    found = []
    for file in benchlib.files_of(path):
        try:
            found.append({"file": file.name, "codecs": gdsckpt.inspect(file).codecs})
        except Exception:
            continue
    return found


# ---------------------------------------------------------------------------------------------
# methods: (save(flat, path), load(template, path))

def gds_method(codec: str) -> tuple[Callable[[dict, Path], None], Callable[[dict, Path], None]]:
    def save(flat: dict[str, Any], path: Path) -> None:
        dcp.save(flat, storage_writer=GdsStorageWriter(path, codec=codec))

    def load(template: dict[str, Any], path: Path) -> None:
        dcp.load(template, storage_reader=GdsStorageReader(path))

    return save, load


def fs_method(zstd: bool) -> tuple[Callable[[dict, Path], None], Callable[[dict, Path], None]]:
    def save(flat: dict[str, Any], path: Path) -> None:
        kwargs: dict[str, Any] = {}
        if zstd:
            from torch.distributed.checkpoint._extension import ZStandard  # torch's, not gdsckpt's

            kwargs["_extensions"] = [ZStandard()]
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True, **kwargs))

    def load(template: dict[str, Any], path: Path) -> None:
        dcp.load(template, storage_reader=dcp.FileSystemReader(str(path)))

    return save, load


def methods(codecs: list[str]) -> dict[str, tuple[Callable, Callable]]:
    table = {f"gdsckpt_dcp[{codec}]": gds_method(codec) for codec in codecs}
    table["dcp_fs"] = fs_method(zstd=False)
    table["dcp_fs_zstd"] = fs_method(zstd=True)
    return table


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def run_method(name: str, save: Callable, load: Callable, flat: dict[str, Any], path: Path, logical: int,
               device: str, errors: dict[str, str], prefix: str,
               barrier: Callable[[], None] = lambda: None, coordinator: bool = True) -> dict[str, Any]:
    """Save durably, drop the files from the page cache, load cold into fresh zero tensors,
    compare bit for bit, delete the files. ``barrier`` brackets each timed step (multi-rank);
    a failing step is recorded in ``errors`` under ``prefix/name/step``."""
    row: dict[str, Any] = {}

    def timed(step: str, fn: Callable[[], None]) -> float | None:
        barrier()
        _sync(device)
        started = time.perf_counter()
        try:
            fn()
            _sync(device)
            seconds: float | None = time.perf_counter() - started
        except BaseException as err:
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            errors[f"{prefix}/{name}/{step}"] = _error(err)
            traceback.print_exc()
            seconds = None
        barrier()
        return seconds

    seconds = timed("save", lambda: save(flat, path))
    if seconds is not None:
        row["save_seconds"], row["save_gbps"] = seconds, logical / seconds / 1e9
        if coordinator:
            row["files"] = len(benchlib.files_of(path))
            row["disk_bytes"] = benchlib.disk_bytes(path)
            row["ratio"] = logical / row["disk_bytes"] if row["disk_bytes"] else None
            row["stored_codecs"] = stored_codecs(path)
            benchlib.make_cold(path)
        template = {k: torch.zeros_like(v) for k, v in flat.items()}
        seconds = timed("load", lambda: load(template, path))
        if seconds is not None:
            row["load_seconds"], row["load_gbps"] = seconds, logical / seconds / 1e9
            bad = benchlib.differences((flat, {}), (template, {}))
            row["bit_exact"] = not bad
            if bad:
                errors[f"{prefix}/{name}/bit_exact"] = f"{len(bad)} differences, e.g. {bad[:3]}"
        del template
    barrier()
    if coordinator:
        shutil.rmtree(path, ignore_errors=True)
    return row


# ---------------------------------------------------------------------------------------------
# multi-rank (spawned processes)

def _rank_main(rank: int, world: int, args: dict[str, Any], run_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    device = args["device"]
    init = f"file://{run_dir}/pg-{world}"
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, timeout=PG_TIMEOUT,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=PG_TIMEOUT)
    report: dict[str, Any] = {"methods": {}, "errors": {}}
    try:
        mesh = DeviceMesh(device, torch.arange(world))
        full = build_state(args["width"], args["depth"], args["steps"], device)
        report["logical_bytes"] = logical = logical_bytes(full)
        flat = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}  # rank 0's values
        del full
        release_gpu_memory()
        for name, (save, load) in methods(args["codecs"]).items():
            path = Path(run_dir) / f"ranks{world}-{name}"
            report["methods"][name] = run_method(name, save, load, flat, path, logical, device,
                                                 report["errors"], f"ranks{world}/rank{rank}",
                                                 barrier=dist.barrier, coordinator=rank == 0)
    except BaseException as err:
        report["errors"][f"ranks{world}/rank{rank}"] = _error(err)
        raise
    finally:
        Path(run_dir, f"ranks{world}-report-{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


def run_ranks(world: int, args: argparse.Namespace, run_dir: Path, errors: dict[str, str]) -> dict[str, Any]:
    """Spawn ``world`` ranks, wait at most ``--timeout`` seconds, and merge their reports."""
    shared = {"device": args.device, "width": args.width, "depth": args.depth, "steps": args.steps,
              "codecs": args.codecs}
    ending = benchlib.spawn_ranks(_rank_main, (world, shared, str(run_dir)), world, args.timeout)
    if ending is not None:
        errors[f"ranks{world}"] = ending
    reports = []
    for rank in range(world):
        path = run_dir / f"ranks{world}-report-{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {"methods": {}, "errors": {}})
    for report in reports:
        errors.update(report["errors"])
    out: dict[str, Any] = {"world": world, "backend": "nccl" if args.device == "cuda" else "gloo",
                           "logical_bytes": reports[0].get("logical_bytes"), "methods": reports[0]["methods"]}
    for name, row in out["methods"].items():  # every rank's verdict
        verdicts = [report["methods"].get(name, {}).get("bit_exact") for report in reports]
        if "bit_exact" in row:
            row["bit_exact"] = all(v is True for v in verdicts)
    return out


# ---------------------------------------------------------------------------------------------
# main

def print_table(results: dict[str, Any]) -> None:
    print(f"{'run':10}{'method':24}{'save GB/s':>10}{'load GB/s':>10}{'ratio':>8}  bit-exact")

    def fmt(value: Any, width: int, digits: int = 3) -> str:
        return f"{value:{width}.{digits}f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"

    runs = [("single", results["single"])] + [(f"ranks={n}", r.get("methods", {}))
                                              for n, r in results["ranks"].items()]
    for label, rows in runs:
        for name, row in rows.items():
            print(f"{label:10}{name:24}{fmt(row.get('save_gbps'), 10)}{fmt(row.get('load_gbps'), 10)}"
                  f"{fmt(row.get('ratio'), 8)}  {row.get('bit_exact', '-')!s:9}")
    for n, r in results["ranks"].items():
        if "skipped" in r:
            print(f"ranks={n}: skipped ({r['skipped']})")


def limits(results: dict[str, Any]) -> dict[str, Any]:
    """Each gdsckpt storage layer against DCP's own FileSystemWriter/Reader of the same run."""
    out = {}
    for label, rows in [("single", results["single"])] + [(f"ranks{n}", r.get("methods", {}))
                                                          for n, r in results["ranks"].items()]:
        reference = rows.get("dcp_fs", {})
        for name, row in rows.items():
            if name.startswith("gdsckpt") and reference.get("save_gbps") and row.get("save_gbps"):
                out[f"{label}/{name}"] = {
                    "ratio": row.get("ratio"), "save_x_dcp_fs": row["save_gbps"] / reference["save_gbps"],
                    "load_x_dcp_fs": (row["load_gbps"] / reference["load_gbps"]
                                      if row.get("load_gbps") and reference.get("load_gbps") else None)}
    return out


def run(args: argparse.Namespace, report: benchlib.Report, run_dir: Path) -> None:
    results: dict[str, Any] = {"single": {}, "ranks": {}}
    report["results"] = results
    errors = report["errors"]
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    results["gpu_count"] = gpus
    flat = build_state(args.width, args.depth, args.steps, args.device)
    # codec="auto" on the GPU measures the storage once per filesystem and caches it (spawned
    # ranks read the cache too): done here, outside the timing
    benchlib.warm_up(run_dir, args.device)
    logical = benchlib.logical_bytes(flat)
    report["state"] = benchlib.describe_state(flat, width=args.width, depth=args.depth, steps=args.steps)
    for name, (save, load) in methods(args.codecs).items():
        results["single"][name] = run_method(name, save, load, flat, run_dir / f"single-{name}", logical,
                                             args.device, errors, "single")
        report.write()  # after every step: a run cut short by a time limit keeps its figures
    del flat
    release_gpu_memory()
    for world in [int(n) for n in args.ranks.split(",") if n.strip()]:
        if args.device == "cuda" and world > gpus:
            results["ranks"][str(world)] = {"skipped": f"only {gpus} GPU{'s' if gpus != 1 else ''}"}
            report["skipped"][f"ranks{world}"] = results["ranks"][str(world)]["skipped"]
            continue
        results["ranks"][str(world)] = run_ranks(world, args, run_dir, errors)
        report.write()
    for label, rows in [("single", results["single"])] + [(f"ranks{n}", r.get("methods", {}))
                                                          for n, r in results["ranks"].items()]:
        for name, row in rows.items():
            if "bit_exact" in row:
                report["checks"][f"{label}/{name}"] = row["bit_exact"]
    report["limits"] = limits(results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if benchlib.cuda_available() else "cpu")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--codecs", default="auto", help="GdsStorageWriter codecs, comma-separated")
    parser.add_argument("--ranks", default="", help="comma-separated rank counts to spawn, e.g. 1,2,4")
    parser.add_argument("--timeout", type=float, default=480.0, help="seconds for one spawned group")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--out", default="dcp-bench.json")
    args = parser.parse_args()
    args.codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    return benchlib.run_benchmark("dcp_bench", args, lambda report, run_dir: run(args, report, run_dir),
                                  lambda report: print_table(report["results"]))


if __name__ == "__main__":
    sys.exit(main())
