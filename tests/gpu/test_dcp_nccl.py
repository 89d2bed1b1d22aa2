"""GPU suite, DCP: ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` through ``GdsStorageWriter`` /
``GdsStorageReader`` with CUDA tensors on NCCL ranks (skipped where CUDA or nvCOMP is absent).

``torch.cuda.device_count()`` ranks are spawned (one on a one-GPU host; nothing here assumes a
count), rank ``r`` on ``cuda:r``, in a ``cpu:gloo,cuda:nccl`` process group (``async_save`` needs
the CPU backend). Their state: a small model and its AdamW state (``get_state_dict``), DTensors
sharded ``Shard(0)`` over every rank and plain values. A second group of CPU ranks (gloo, one
more rank than the first, so DCP reshards) loads what the CUDA ranks saved. Every comparison is
bit-exact against full copies the saving ranks wrote with ``torch.save``.

Run on a GPU host with:  python3 -m pytest -m gpu tests/gpu/test_dcp_nccl.py -rA
(``-rA`` also prints which engine wrote each rank file.)
"""

from __future__ import annotations

import datetime
import json
import re
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from gdsckpt.codecs.nvcomp import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs CUDA, CuPy and nvCOMP")]

import gdsckpt
from gdsckpt.demo import bit_equal


def _load_spawn_ranks() -> Any:
    """``benchmarks/benchlib.py``'s ``spawn_ranks`` (spawn with a deadline), which
    ``benchmarks/dcp_bench.py`` uses too; ``benchmarks`` is not a package."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "benchlib.py"
    spec = importlib.util.spec_from_file_location("gdsckpt_bench_spawn_ranks", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.spawn_ranks


_spawn_ranks = _load_spawn_ranks()
GROUP_SECONDS = 240  # one spawned process group, start to end; the PG's own timeout is 60 s
PG_TIMEOUT = datetime.timedelta(seconds=60)
# Small chunks, so that every rank file holds several chunks and packs.
WRITER_OPTIONS = {"gpu_chunk_bytes": 64 << 10, "chunk_bytes": 64 << 10, "pack_below": 16 << 10,
                  "max_staging_bytes": 64 << 20, "timeout": 120.0}
# What each checkpoint directory is written with. DCP's async_save hands GdsStorageWriter CPU
# copies (its default stager), so "auto" runs the CPU engine there (an "ans" writer would fail:
# ANS has no CPU implementation) unless engine="gpu" sends the staged copies through nvCOMP.
DIRECTORIES = {"ans": {"codec": "ans"}, "zstd": {"codec": "zstd"}, "auto-async": {"codec": "auto"},
               "ans-gpu-async": {"codec": "ans", "engine": "gpu"}}


# ---------------------------------------------------------------------------------------------
# worker side (runs in spawned processes; never forked after CUDA is initialised)

def _spy_engines(log: list[dict[str, Any]]) -> None:
    """Record the engine and backend of every ``gdsckpt.save`` that ``GdsStorageWriter`` runs."""
    from gdsckpt import api

    original = api.save

    def spy(*args: Any, **kwargs: Any) -> Any:
        report = original(*args, **kwargs)
        path = Path(report.path)
        log.append({"dir": path.parent.name, "file": path.name, "engine": report.engine,
                    "backend": report.backend, "codec": report.codec, "chains": report.chains})
        return report

    api.save = spy


def _live_state(world: int, mesh: Any, device: Any) -> dict[str, Any]:
    """The saving ranks' state: identical on every rank (rank 0's values are broadcast)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        x = torch.randn(16, 64, generator=g).to(device)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    g = torch.Generator().manual_seed(6)
    nan = torch.tensor([0x7FC0_1234, -0x8000_0000, 0x7F80_0001], dtype=torch.int32).view(torch.float32)
    full = {"w": (torch.randn(512, 256, generator=g) * 0.02).to(torch.bfloat16),  # compressible
            "h": torch.randn(37, 5, generator=g).to(torch.float16),                # uneven shards
            "z": torch.zeros(1000, 3, dtype=torch.int32),
            "i": torch.randint(-2**40, 2**40, (world * 3 + 1,), generator=g, dtype=torch.int64)}
    state = {"model": model_sd, "optim": optim_sd,
             "sharded": {k: distribute_tensor(v.to(device), mesh, [Shard(0)]) for k, v in full.items()},
             "extra": {"step": 17, "name": "run-α", "nan": nan.to(device), "t": torch.arange(12.0).to(device)
                       .reshape(3, 4).t()}}
    # the trained (replicated) entries: every rank holds rank 0's bits, whatever its GPU computed
    for tensor in _tensors({"model": model_sd, "optim": optim_sd}):
        dist.broadcast(tensor, src=0)
    return state


def _tensors(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def _map(tree: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(v, fn) for v in tree)
    return fn(tree)


def _full_on_cpu(value: Any) -> Any:
    """A tensor (a DTensor gathered whole: a collective) as a CPU copy; other values as they are."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _blank(value: Any) -> Any:
    """A load target: zeros of the same kind, device and sharding; other values changed, so that
    only a load can bring them back."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "~"
    return value


def _compare(loaded: Any, expected: Any, where: str = "") -> list[str]:
    """Differences between a loaded tree and the expected full CPU copies (DTensors gathered)."""
    if isinstance(expected, dict):
        if not isinstance(loaded, dict) or loaded.keys() != expected.keys():
            return [f"{where}: keys {sorted(getattr(loaded, 'keys', list)())} != {sorted(expected)}"]
        return [d for k in expected for d in _compare(loaded[k], expected[k], f"{where}/{k}")]
    if isinstance(expected, (list, tuple)):
        if not isinstance(loaded, (list, tuple)) or len(loaded) != len(expected):
            return [f"{where}: {loaded!r} != {expected!r}"]
        return [d for i, (a, b) in enumerate(zip(loaded, expected)) for d in _compare(a, b, f"{where}/{i}")]
    if isinstance(expected, torch.Tensor):
        got = _full_on_cpu(loaded) if isinstance(loaded, torch.Tensor) else loaded
        if not isinstance(got, torch.Tensor) or not bit_equal(got, expected):
            return [f"{where}: not bit-exact"]
        return []
    return [] if loaded == expected else [f"{where}: {loaded!r} != {expected!r}"]


def _cpu_targets(expected: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """Load targets on CPU ranks: the same tree, ``sharded`` as DTensors on a CPU mesh."""
    from torch.distributed.tensor import Shard, distribute_tensor

    targets = _map({k: v for k, v in expected.items() if k != "sharded"}, _blank)
    targets["sharded"] = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)])
                          for k, v in expected["sharded"].items()}
    return targets


def _run_job(job: str, where: Path, rank: int, state: dict[str, Any] | None, mesh: Any,
             save_group: Any) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from gdsckpt.config import Config
    from gdsckpt.dcp import GdsStorageReader, GdsStorageWriter

    info: dict[str, Any] = {}
    if job in ("save", "async_save"):
        assert state is not None
        options = DIRECTORIES.get(where.name, {"codec": where.name.split("-")[0]})
        writer = GdsStorageWriter(where, **WRITER_OPTIONS, **options)
        if job == "async_save":
            started = time.monotonic()
            future = dcp.async_save(state, storage_writer=writer, process_group=save_group)
            info["staged_seconds"] = time.monotonic() - started
            future.result(timeout=120)
        else:
            dcp.save(state, storage_writer=writer)
        expected = _map(state, _full_on_cpu)  # collectives: every rank, same order
        if rank == 0:
            torch.save(expected, where.parent / f"{where.name}.expected.pt")
        return info
    expected = torch.load(where.parent / f"{where.name}.expected.pt", weights_only=False)
    if job == "load_live":
        assert state is not None
        targets = _map(state, _blank)
        dcp.load(targets, storage_reader=GdsStorageReader(where))
        devices = {str(t.device) for t in _tensors(targets)}
        info["devices"] = sorted(devices)
    elif job in ("load_cpu", "load_cpu_engine"):
        targets = _cpu_targets(expected, mesh)
        config = Config(engine="cpu") if job == "load_cpu_engine" else None
        dcp.load(targets, storage_reader=GdsStorageReader(where, config=config))
    else:  # pragma: no cover
        raise ValueError(job)
    problems = _compare(targets, expected)
    if problems:
        raise AssertionError("; ".join(problems[:10]))
    return info


def _worker(rank: int, world: int, root: str, tag: str, device_kind: str,
            jobs: list[tuple[str, str]]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    engines: list[dict[str, Any]] = []
    _spy_engines(engines)
    if device_kind == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{root}/pg-{tag}", rank=rank,
                                world_size=world, timeout=PG_TIMEOUT, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"file://{root}/pg-{tag}", rank=rank, world_size=world,
                                timeout=PG_TIMEOUT)
    report: dict[str, Any] = {"jobs": {}, "engines": engines}
    try:
        mesh = DeviceMesh(device_kind, torch.arange(world))
        saves = any(job.startswith(("save", "async")) for job, _where in jobs)
        state = _live_state(world, mesh, device) if saves else None
        # async_save's collectives run on a thread of their own: they get a gloo group of their own
        save_group = dist.new_group(backend="gloo") if saves else None
        for job, where in jobs:
            entry: dict[str, Any] = {"error": None}
            try:
                entry.update(_run_job(job, Path(root) / where, rank, state, mesh, save_group))
            except BaseException as err:
                entry["error"] = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
            report["jobs"][f"{job}:{where}"] = entry
            dist.barrier()
    finally:
        (Path(root) / f"report-{tag}-{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


def spawn(world: int, root: Path, tag: str, device_kind: str,
          jobs: list[tuple[str, str]]) -> tuple[list[dict[str, Any]], str | None]:
    """Run ``jobs`` on ``world`` spawned ranks; returns each rank's report and how the ranks ended
    (None: every one exited 0). Ranks still running after ``GROUP_SECONDS`` are terminated; a
    group that left no report for some rank raises."""
    ending = _spawn_ranks(_worker, (world, str(root), tag, device_kind, jobs), world, GROUP_SECONDS)
    missing = [r for r in range(world) if not (root / f"report-{tag}-{r}.json").exists()]
    if missing:
        raise RuntimeError(f"process group {tag!r} ({world} {device_kind} ranks): no report from ranks "
                           f"{missing}; {ending}")
    return [json.loads((root / f"report-{tag}-{r}.json").read_text()) for r in range(world)], ending


# ---------------------------------------------------------------------------------------------
# tests

@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two process groups, one after the other: N = device_count CUDA ranks save with
    ``dcp.save`` (``ans``, ``zstd``) and ``dcp.async_save`` (``auto``; ``ans`` with
    ``engine="gpu"``) and load back onto their GPUs; N + 1 CPU ranks (gloo) then load the same
    checkpoints."""
    root = tmp_path_factory.mktemp("dcp-nccl")
    world = torch.cuda.device_count()
    cuda, cuda_ending = spawn(world, root, "cuda", "cuda", [
        ("save", "ans"), ("load_live", "ans"), ("save", "zstd"), ("async_save", "auto-async"),
        ("load_live", "auto-async"), ("async_save", "ans-gpu-async"), ("load_live", "ans-gpu-async")])
    cpu, cpu_ending = spawn(world + 1, root, "cpu", "cpu", [
        ("load_cpu", "ans"), ("load_cpu_engine", "zstd"), ("load_cpu", "auto-async"),
        ("load_cpu", "ans-gpu-async")])
    return {"root": root, "world": world, "cuda": cuda, "cpu": cpu,
            "endings": {"cuda": cuda_ending, "cpu": cpu_ending}}


def _errors(reports: list[dict[str, Any]], entry: str) -> list[str]:
    return [f"rank {r}: {report['jobs'][entry]['error']}" for r, report in enumerate(reports)
            if report["jobs"][entry]["error"] is not None]


def _saves(reports: list[dict[str, Any]], directory: str) -> list[dict[str, Any]]:
    """The ``gdsckpt.save`` calls the ranks made into ``directory``, in rank order."""
    return [entry for report in reports for entry in report["engines"] if entry["dir"] == directory]


def _rank_files(groups: dict[str, Any], directory: str) -> list[Path]:
    """Each rank's one file in ``directory`` (``__<rank>_<file id>.gdsckpt``), in rank order:
    a finished save leaves exactly one per rank."""
    root, world = groups["root"], groups["world"]
    files = sorted((root / directory).glob("__*.gdsckpt"))
    by_rank = [[f for f in files if re.fullmatch(rf"__{rank}_[0-9a-f]{{32}}\.gdsckpt", f.name)]
               for rank in range(world)]
    assert all(len(found) == 1 for found in by_rank) and len(files) == world, [f.name for f in files]
    return [found[0] for found in by_rank]


def test_ranks_exit_cleanly(groups: dict[str, Any]) -> None:
    assert groups["endings"] == {"cuda": None, "cpu": None}


@pytest.mark.parametrize("entry", ["save:ans", "save:zstd", "async_save:auto-async",
                                   "async_save:ans-gpu-async"])
def test_cuda_ranks_save(groups: dict[str, Any], entry: str) -> None:
    assert not _errors(groups["cuda"], entry)


@pytest.mark.parametrize("entry", ["load_live:ans", "load_live:auto-async", "load_live:ans-gpu-async"])
def test_cuda_ranks_load_bit_exact_onto_their_gpus(groups: dict[str, Any], entry: str) -> None:
    assert not _errors(groups["cuda"], entry)
    for rank, report in enumerate(groups["cuda"]):
        # the CPU tensors among the targets (AdamW's step) stay on the CPU, the others on cuda:rank
        devices = set(report["jobs"][entry]["devices"])
        assert f"cuda:{rank}" in devices and devices <= {"cpu", f"cuda:{rank}"}, devices


@pytest.mark.parametrize("entry", ["load_cpu:ans", "load_cpu_engine:zstd", "load_cpu:auto-async",
                                   "load_cpu:ans-gpu-async"])
def test_cpu_ranks_load_what_cuda_ranks_saved(groups: dict[str, Any], entry: str) -> None:
    """Cross-device and resharding: N CUDA ranks saved, N + 1 CPU ranks load; the ``zstd``
    streams nvCOMP wrote are decoded by the CPU engine (``engine="cpu"``)."""
    assert not _errors(groups["cpu"], entry)


def _check_gpu_written(groups: dict[str, Any], directory: str) -> None:
    """Every rank's file in ``directory`` came from the GPU engine (kvikio writer, nvCOMP chains)
    and holds nvCOMP ANS streams."""
    saves = _saves(groups["cuda"], directory)
    print(f"{directory}:", json.dumps(saves))
    paths = _rank_files(groups, directory)
    assert [save["file"] for save in saves] == [path.name for path in paths]
    for save in saves:
        assert save["engine"] == "gpu" and save["backend"].startswith("kvikio"), save
    labels: dict[str, int] = {}
    for path in paths:
        info = gdsckpt.inspect(path)
        for label, count in info.codecs.items():
            labels[label] = labels.get(label, 0) + count
        # a file of the GPU engine: every chunk nvCOMP-coded or stored raw, none by the CPU's zstd
        assert all("nvcomp." in label or label == "none/1" for label in info.codecs), (path.name, info.codecs)
        gdsckpt.verify(path)
    assert any(label.endswith("nvcomp.ans/1") for label in labels), labels


def test_sync_save_ran_the_gpu_engine_with_nvcomp_ans(groups: dict[str, Any]) -> None:
    _check_gpu_written(groups, "ans")
    for rank, path in enumerate(_rank_files(groups, "ans")):  # each rank's CUDA tensors came from its own GPU
        info = gdsckpt.inspect(path)
        devices = {t.device for t in info.tensors}
        assert f"cuda:{rank}" in devices and devices <= {"cpu", f"cuda:{rank}"}, devices


def test_async_save_with_engine_gpu_runs_nvcomp_on_the_staged_copies(groups: dict[str, Any]) -> None:
    _check_gpu_written(groups, "ans-gpu-async")


def test_zstd_save_of_cuda_state_ran_the_cpu_engine_and_is_portable(groups: dict[str, Any]) -> None:
    saves = _saves(groups["cuda"], "zstd")
    print("dcp.save (zstd):", json.dumps(saves))
    assert len(saves) == groups["world"] and all(save["engine"] == "cpu" for save in saves), saves
    for path in _rank_files(groups, "zstd"):
        codecs = gdsckpt.inspect(path).codecs
        assert all(label.endswith(("zstd/1", "none/1")) for label in codecs), codecs
        gdsckpt.verify(path, config=gdsckpt.Config(engine="cpu"))


def test_async_save_default_writer(groups: dict[str, Any]) -> None:
    """DCP's default stager copies the state to CPU memory before ``GdsStorageWriter`` sees it,
    so ``codec="auto"`` runs whichever engine a CPU state gets (printed with ``-rA``)."""
    saves = _saves(groups["cuda"], "auto-async")
    print("auto-async:", json.dumps(saves))
    assert len(saves) == groups["world"], saves
    directory = groups["root"] / "auto-async"
    assert (directory / ".metadata").exists()
    for path in _rank_files(groups, "auto-async"):
        gdsckpt.verify(path)
