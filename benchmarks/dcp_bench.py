#!/usr/bin/env python3
"""DCP benchmark: torch.distributed.checkpoint save / load through gdsckpt's storage layer
(``GdsStorageWriter`` / ``GdsStorageReader``) against DCP's own ``FileSystemWriter`` /
``FileSystemReader``, plain and with DCP's zstd extension, on one training state.

The state is gpu_bench.py's (``build_state``: a ``gdsckpt.demo.TinyGPT`` trained ``--steps``
AdamW steps; bf16 weights + fp32 master weights + exp_avg + exp_avg_sq), built on the GPU with
``--device cuda``; with ``--device cpu`` the same layout is built on the CPU from
``gdsckpt.demo.training_state``. Every method gets the same flat dict (gpu_bench's
``flat_dict``, keys joined with "."), so the logical bytes are the same for all:

- ``gdsckpt_dcp[<codec>]``: ``dcp.save`` with ``GdsStorageWriter(codec=<codec>)`` (one per
  ``--codecs`` entry), ``dcp.load`` with ``GdsStorageReader``,
- ``dcp_fs`` / ``dcp_fs_zstd``: gpu_bench's ``dcp_save`` (``FileSystemWriter(sync_files=True)``,
  without / with ``_extensions=[ZStandard()]``), ``dcp.load`` with ``FileSystemReader``.

Writes are durable (the writers fsync inside the timing: ``sync_files=True``; gdsckpt fsyncs
file and directory); reads are cold (every file of the checkpoint is fsynced and dropped from
the page cache with posix_fadvise(DONTNEED) before the load, as gpu_bench.py does). Every load
goes into fresh zero tensors on the state's device and is compared bit for bit with the source.
GB/s is logical tensor bytes (10**9) over wall seconds; ratio is logical bytes over the bytes of
every file of the checkpoint directory.

First in this process, without a process group; then, for each ``--ranks`` entry N, on N
spawned ranks (NCCL, rank r on cuda:r; gloo on the CPU) holding the same state sharded
``Shard(0)`` as DTensors: the aggregate GB/s is the global logical bytes over rank 0's time from
the barrier before to the barrier after. N above the GPU count is recorded as skipped. One
method's failure is recorded in ``errors`` and the run goes on. JSON goes to ``--out``; a short
table is printed last.

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
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
for _path in (BENCH.parent, BENCH):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch
import torch.distributed.checkpoint as dcp
from cpu_bench import host_info
from gpu_bench import build_state as gpu_state
from gpu_bench import dcp_save as fs_save
from gpu_bench import drop_cache, flat_dict
from spawn_ranks import spawn_ranks

import gdsckpt
from gdsckpt.dcp import GdsStorageReader, GdsStorageWriter
from gdsckpt.demo import bit_equal, training_state

# Without a process group DCP warns on every call that it assumes a single process: it does here.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")

PG_TIMEOUT = datetime.timedelta(seconds=120)
VERSIONS = ("torch", "numpy", "zstandard", "lz4", "crc32c", "cupy-cuda13x", "cupy-cuda12x", "nvidia-nvcomp-cu13",
            "nvidia-nvcomp-cu12", "kvikio-cu13", "kvikio-cu12")


# ---------------------------------------------------------------------------------------------
# state, timing, files

def build_state(width: int, depth: int, steps: int, device: str) -> dict[str, Any]:
    """gpu_bench's state on the current CUDA device; on the CPU the same layout (bf16 weights,
    fp32 master weights, AdamW's exp_avg / exp_avg_sq) of a ``demo.training_state`` model."""
    if device == "cuda":
        return gpu_state(width, depth, steps)
    model, optimizer = training_state(width=width, depth=depth, steps=steps, device=device, vocab=8192)
    names = {id(p): n for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    return {"model": {n: p.detach().to(torch.bfloat16) for n, p in params.items()},
            "master": {n: p.detach().clone() for n, p in params.items()},
            "optimizer": {names[id(p)]: {k: v for k, v in s.items() if k != "step"}
                          for p, s in optimizer.state.items()}}


def dotted(state: dict[str, Any]) -> dict[str, Any]:
    """gpu_bench's ``flat_dict`` with DCP's own separator, ``model.blocks.0.qkv.weight``: an FQN
    holding "/" or "~" is escaped twice by ``GdsStorageWriter`` (its ``item_key``, then
    ``gdsckpt.save``'s own key escaping), so ``GdsStorageReader`` does not find it."""
    return {key.replace("/", "."): value for key, value in flat_dict(state).items()}


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


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def files_of(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def mismatches(loaded: dict[str, Any], source: dict[str, Any]) -> list[str]:
    return [k for k, v in source.items() if not bit_equal(_local(loaded[k]), _local(v))]


class EngineLog:
    """Records the engine, backend and codec chains of each ``gdsckpt.save`` that
    ``GdsStorageWriter`` runs (one per rank file), so the JSON says whether the GPU engine wrote."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def __enter__(self) -> None:
        from gdsckpt import api

        self._api, self._original = api, api.save

        def spy(*args: Any, **kwargs: Any) -> Any:
            report = self._original(*args, **kwargs)
            self.entries.append({"file": Path(report.path).name, "engine": report.engine,
                                 "backend": report.backend, "codec": report.codec, "chains": report.chains})
            return report

        api.save = spy

    def __exit__(self, *exc: object) -> None:
        self._api.save = self._original


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
        fs_save(flat, path, zstd=zstd)  # flat_dict of a flat dict is the same dict

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
    log = EngineLog()

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

    with log:
        seconds = timed("save", lambda: save(flat, path))
    row["engines"] = log.entries
    if seconds is not None:
        row["save_seconds"], row["save_gbps"] = seconds, logical / seconds / 1e9
        if coordinator:
            files = files_of(path)
            row["files"] = len(files)
            row["disk_bytes"] = sum(f.stat().st_size for f in files)
            row["ratio"] = logical / row["disk_bytes"] if row["disk_bytes"] else None
            for file in files:
                drop_cache(file)
        template = {k: torch.zeros_like(v) for k, v in flat.items()}
        seconds = timed("load", lambda: load(template, path))
        if seconds is not None:
            row["load_seconds"], row["load_gbps"] = seconds, logical / seconds / 1e9
            bad = mismatches(template, flat)
            row["bit_exact"] = not bad
            if bad:
                errors[f"{prefix}/{name}/bit_exact"] = f"{len(bad)} tensors differ, e.g. {bad[:3]}"
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
        full = dotted(build_state(args["width"], args["depth"], args["steps"], device))
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
    ending = spawn_ranks(_rank_main, (world, shared, str(run_dir)), world, args.timeout)
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
    for name, row in out["methods"].items():  # every rank's engines, every rank's verdict
        row["engines"] = [e for report in reports for e in report["methods"].get(name, {}).get("engines", [])]
        verdicts = [report["methods"].get(name, {}).get("bit_exact") for report in reports]
        if "bit_exact" in row:
            row["bit_exact"] = all(v is True for v in verdicts)
    return out


# ---------------------------------------------------------------------------------------------
# main

def versions() -> dict[str, str]:
    found = {"gdsckpt": gdsckpt.__version__}
    for name in VERSIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def print_table(results: dict[str, Any]) -> None:
    print(f"{'run':10}{'method':24}{'save GB/s':>10}{'load GB/s':>10}{'ratio':>8}  bit-exact  engine")

    def fmt(value: Any, width: int, digits: int = 3) -> str:
        return f"{value:{width}.{digits}f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"

    runs = [("single", results["single"])] + [(f"ranks={n}", r.get("methods", {}))
                                              for n, r in results["ranks"].items()]
    for label, rows in runs:
        for name, row in rows.items():
            engines = sorted({e["engine"] for e in row.get("engines", [])}) or ["-"]
            print(f"{label:10}{name:24}{fmt(row.get('save_gbps'), 10)}{fmt(row.get('load_gbps'), 10)}"
                  f"{fmt(row.get('ratio'), 8)}  {row.get('bit_exact', '-')!s:9}  {','.join(engines)}")
    for n, r in results["ranks"].items():
        if "skipped" in r:
            print(f"ranks={n}: skipped ({r['skipped']})")
    for key, error in results["errors"].items():
        print(f"error {key}: {error[:200]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
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
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    ranks = [int(n) for n in args.ranks.split(",") if n.strip()]
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="dcp-bench-", dir=args.dir))
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    results: dict[str, Any] = {
        "benchmark": "dcp_bench", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": host_info(run_dir), "versions": versions(), "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if gpus else None, "gpu_count": gpus, "width": args.width,
        "depth": args.depth, "steps": args.steps, "codecs": args.codecs, "single": {}, "ranks": {}, "errors": {},
    }
    errors = results["errors"]

    def dump() -> None:  # after every step: a run cut short by a time limit still leaves its figures
        Path(args.out).write_text(json.dumps(results, indent=1))

    try:
        flat = dotted(build_state(args.width, args.depth, args.steps, args.device))
        if args.device == "cuda" and "auto" in args.codecs:
            from gdsckpt.pipeline.autotune import storage_gbps

            # codec="auto" on the GPU measures the storage once per filesystem and caches it in a
            # file (spawned ranks read it too): measured here, outside the timing, as gpu_bench does
            results["storage_gbps_probe"] = storage_gbps(run_dir)
        results["logical_bytes"] = logical = logical_bytes(flat)
        results["tensors"] = len(flat)
        for name, (save, load) in methods(args.codecs).items():
            results["single"][name] = run_method(name, save, load, flat, run_dir / f"single-{name}", logical,
                                                 args.device, errors, "single")
            dump()
        del flat
        release_gpu_memory()
        for world in ranks:
            if args.device == "cuda" and world > gpus:
                results["ranks"][str(world)] = {"skipped": f"only {gpus} GPU{'s' if gpus != 1 else ''}"}
                continue
            results["ranks"][str(world)] = run_ranks(world, args, run_dir, errors)
            dump()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        dump()
    print(f"state: {results.get('logical_bytes', 0) / 1e9:.3f} GB in {results.get('tensors')} tensors on "
          f"{args.device}; wrote {args.out}")
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
