"""Shared helpers of the benchmark suite: the training state, host facts, durable writes and cold
reads, the bit-exact check, timing, spawned ranks and the one JSON schema every benchmark writes.

Only public gdsckpt names are used (``gdsckpt``, ``gdsckpt.demo``), so the benchmarks keep working
however the package is laid out inside. Each benchmark script imports this module by name: Python
puts a script's own directory first on ``sys.path``.

The JSON schema (``SCHEMA``), one object per run::

    schema     "gdsckpt-bench/1"
    benchmark  the script's name, e.g. "save_load_bench"
    command    the argv that ran it;  args: its parsed arguments
    host       host_facts(): date, hostname, CPU count, versions (python, torch, numpy, gdsckpt,
               CUDA libraries when present), GPU name or null, filesystem of the benchmark directory
    device     "cpu" or "cuda"
    state      what was saved (layout, logical bytes, tensors)
    results    the benchmark's figures (each benchmark documents its own)
    limits     figures next to their limit (e.g. save GB/s against ratio x raw write of the same disk)
    checks     name -> bool: every bit-exact comparison the run made
    bit_exact  all(checks) (null when the run compared nothing)
    errors     name -> message of anything that failed (the rest of the run goes on)
    skipped    name -> why it did not run
    seconds    wall time of the whole run
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA = "gdsckpt-bench/1"
REQUIRED_KEYS = ("schema", "benchmark", "command", "args", "host", "device", "state", "results", "limits",
                 "checks", "bit_exact", "errors", "skipped", "seconds")
HOST_KEYS = ("date", "hostname", "cpu_count", "python", "versions", "gpu", "filesystem")
REPO = Path(__file__).resolve().parent.parent
DISTRIBUTIONS = ("torch", "numpy", "gdsckpt", "zstandard", "lz4", "crc32c", "safetensors", "cupy-cuda13x",
                 "cupy-cuda12x", "nvidia-nvcomp-cu13", "nvidia-nvcomp-cu12", "kvikio-cu13", "kvikio-cu12")
# The mixed-precision layout's model: heads, sequence length, batch and learning rate of every
# benchmark, so that their states and training loops are the same at the same width and depth.
VOCAB, CONTEXT, BATCH, LR = 8192, 128, 4, 1e-4
MOMENTS = ("exp_avg", "exp_avg_sq")
# DCP without a process group warns on every call that it assumes a single process: it does here.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")


# ---------------------------------------------------------------------------------------------
# sizes, devices, timing

def parse_size(text: str | int) -> int:
    """``"256MiB"``, ``"1GiB"``, ``"4096"`` -> bytes (binary units, as gdsckpt's own options)."""
    if isinstance(text, int):
        return text
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    return int(lowered)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str = "cpu") -> float:
    """Wall seconds of ``fn()``, with the GPU idle before and after (queued work counts)."""
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - started


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------
# the training state

def heads_for(width: int) -> int:
    return 16 if width % 16 == 0 and width >= 256 else max(1, width // 64)


def shape_for_bytes(target: int) -> tuple[int, int]:
    """Width and depth of a TinyGPT whose mixed-precision state is about ``target`` bytes
    (14 bytes per parameter: bf16 copy, fp32 master, two fp32 moments)."""
    params = max(1, target // 14)
    width, depth = 64, 1
    for width in (64, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096):
        fixed = 2 * VOCAB * width + CONTEXT * width + 2 * width
        depth = max(1, round((params - fixed) / (12 * width * width + 13 * width)))
        if depth <= 12:
            break
    return width, depth


def build_training(width: int, depth: int, steps: int, device: str, *, seed: int = 0) -> tuple[Any, Any]:
    """A ``gdsckpt.demo.TinyGPT`` and its AdamW optimizer after ``steps`` steps on random tokens."""
    import torch

    from gdsckpt.demo import TinyGPT, train_steps

    torch.manual_seed(seed)
    model = TinyGPT(vocab=VOCAB, width=width, depth=depth, heads=heads_for(width), context=CONTEXT).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    train_steps(model, optimizer, steps, seed=seed, batch=BATCH, length=CONTEXT)
    sync(device)
    return model, optimizer


def train(model: Any, optimizer: Any, steps: int, *, seed: int) -> float:
    """``steps`` more steps of the benchmarks' loop; returns the last loss."""
    from gdsckpt.demo import train_steps

    return train_steps(model, optimizer, steps, seed=seed, batch=BATCH, length=CONTEXT)


def mixed_precision_state(model: Any, optimizer: Any, *, copy: bool = True) -> dict[str, Any]:
    """The layout every benchmark saves: bf16 weights, fp32 master weights, AdamW's exp_avg and
    exp_avg_sq per parameter. ``copy=False`` shares the live master weights and moments."""
    import torch

    names = {id(p): n for n, p in model.named_parameters()}
    return {"model": {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()},
            "master": {n: p.detach().clone() if copy else p.detach() for n, p in model.named_parameters()},
            "optimizer": {names[id(p)]: {k: s[k].clone() if copy else s[k] for k in MOMENTS}
                          for p, s in optimizer.state.items()}}


def live_state(model: Any, optimizer: Any, step: int) -> dict[str, Any]:
    """What a training loop checkpoints (README): the model's and the optimizer's state_dict."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}


def build_state(width: int, depth: int, steps: int, device: str) -> dict[str, Any]:
    model, optimizer = build_training(width, depth, steps, device)
    state = mixed_precision_state(model, optimizer)
    sync(device)
    return state


def sized_state(report: Any, size: str | int, steps: int, device: str) -> tuple[Any, int]:
    """The benchmark state of about ``size`` bytes (``build_state`` after ``steps`` steps, on
    ``device``) and its logical bytes; ``report["state"]`` describes it."""
    width, depth = shape_for_bytes(parse_size(size))
    state = build_state(width, depth, steps, device)
    report["state"] = describe_state(state, width=width, depth=depth, steps=steps)
    return state, logical_bytes(state)


def describe_state(state: Any, **extra: Any) -> dict[str, Any]:
    tensors = flatten(state)[0]
    by_dtype: dict[str, int] = {}
    for tensor in tensors.values():
        name = str(tensor.dtype).replace("torch.", "")
        by_dtype[name] = by_dtype.get(name, 0) + tensor.numel() * tensor.element_size()
    return {"layout": "bf16 weights + fp32 master weights + AdamW exp_avg / exp_avg_sq", **extra,
            "logical_bytes": sum(by_dtype.values()), "tensors": len(tensors), "bytes_by_dtype": by_dtype}


def flatten(obj: Any, prefix: str = "", sep: str = "/") -> tuple[dict[str, Any], dict[str, Any]]:
    """Tensors and plain leaves of a nested state, keyed by joined paths."""
    import torch

    tensors: dict[str, Any] = {}
    plain: dict[str, Any] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            tensors[path] = node
        elif isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}{sep}{key}" if path else str(key))
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(value, f"{path}{sep}{i}" if path else str(i))
        else:
            plain[path] = node

    walk(obj, prefix)
    return tensors, plain


def logical_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in flatten(state)[0].values())


def differences(want: Any, got: Any, *, tensors_only: bool = False) -> list[str]:
    """What differs between two states (nested, or already ``flatten``-ed); empty when bit-exact
    (same keys, dtypes, shapes and bit patterns, NaN payloads included)."""
    from gdsckpt.demo import bit_equal

    want_tensors, want_plain = want if isinstance(want, tuple) else flatten(want)
    got_tensors, got_plain = got if isinstance(got, tuple) else flatten(got)
    problems = []
    if set(want_tensors) != set(got_tensors):
        problems.append(f"tensor keys differ (missing {sorted(set(want_tensors) - set(got_tensors))[:3]}, "
                        f"extra {sorted(set(got_tensors) - set(want_tensors))[:3]})")
    for key, tensor in want_tensors.items():
        other = got_tensors.get(key)
        if other is not None:
            local = other.to_local() if hasattr(other, "to_local") else other
            mine = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if not bit_equal(mine, local):
                problems.append(f"{key}: not bit-equal")
    if not tensors_only:
        for key, value in want_plain.items():
            if key not in got_plain or got_plain[key] != value:
                problems.append(f"{key}: plain value {got_plain.get(key)!r} != {value!r}")
    return problems


# ---------------------------------------------------------------------------------------------
# durable writes, cold reads

def files_of(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def fsync_tree(path: Path) -> None:
    """Make ``path`` (a file, or a directory and every file under it) durable as ``gdsckpt.save``
    makes its file: the contents, and the directory entries that name them (a new file whose
    directory was not fsynced may be missing after a crash)."""
    from gdsckpt.io.posix import fsync_directory

    files = files_of(path)
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for directory in sorted({file.parent for file in files} | {path.parent}):
        fsync_directory(directory)


def durable_torch_save(state: Any, path: Path) -> None:
    """``torch.save`` with its file and directory entry fsynced (``fsync_tree``)."""
    import torch

    with path.open("wb") as handle:
        torch.save(state, handle)
    fsync_tree(path)


def can_drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def make_cold(path: Path, *, drop_caches: bool = False) -> None:
    """Push every file of ``path`` out of the page cache (fsync, then posix_fadvise DONTNEED), and
    the whole cache with ``drop_caches`` (needs root), so the next read comes from storage."""
    for file in files_of(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if drop_caches:
        can_drop_caches()


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in files_of(path))


def warm_up(directory: Path, device: str) -> None:
    """One small save and load in ``directory`` before anything is timed, as a process that has
    checkpointed once has done: kernels load on first use and ``codec="auto"`` measures and caches
    the storage's speed once per filesystem; neither belongs in a save's time or memory."""
    import torch

    import gdsckpt

    path = directory / "warm-up.gdsckpt"
    gdsckpt.save({"w": torch.randn(1 << 20, device=device)}, path)
    gdsckpt.load(path, device=device)
    path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# gdsckpt configuration variants

def config_variant(fields: str, base: Any = None) -> Any:
    """``"engine=cpu,async_worker=process"`` -> ``base`` (default ``gdsckpt.Config.from_env()``)
    with those fields, each value written as its ``GDSCKPT_<FIELD>`` environment variable takes it;
    ``"@path.toml"`` or ``"@preset-name"``: that config file or shipped preset over ``base``."""
    import gdsckpt

    base = gdsckpt.Config.from_env() if base is None else base
    if fields.startswith("@"):
        name = fields[1:]
        if name in gdsckpt.config.preset_names():
            return gdsckpt.Config.preset(name, base=base)
        return gdsckpt.Config.from_toml(name, base=base)
    pairs = dict(pair.split("=", 1) for pair in fields.split(",") if pair)
    parsed = gdsckpt.Config.from_env({f"GDSCKPT_{key.upper()}": value for key, value in pairs.items()})
    unknown = [key for key in pairs if not hasattr(parsed, key)]
    if unknown:
        raise ValueError(f"not gdsckpt.Config fields: {unknown}")
    return base.replace(**{key: getattr(parsed, key) for key in pairs})


def config_dict(config: Any) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


# ---------------------------------------------------------------------------------------------
# host facts and the report

def filesystem_of(directory: Path) -> dict[str, str]:
    real = str(directory.resolve())
    best = {"mount_point": "", "type": "?", "device": "?"}
    try:
        with open("/proc/mounts") as handle:
            for line in handle:
                device, mount_point, fstype, *_ = line.split()
                mount_point = mount_point.replace("\\040", " ")
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best["mount_point"]):
                    best = {"mount_point": mount_point, "type": fstype, "device": device}
    except OSError:
        pass
    return best


def _first_line(path: str, prefix: str) -> str | None:
    try:
        with open(path) as handle:
            return next((line.split(":", 1)[1].strip() for line in handle if line.startswith(prefix)), None)
    except OSError:
        return None


def host_facts(directory: Path) -> dict[str, Any]:
    versions = {"python": platform.python_version()}
    for name in DISTRIBUTIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    import gdsckpt

    versions["gdsckpt"] = gdsckpt.__version__  # the imported one, which may not be the installed one
    gpu = None
    if cuda_available():
        import torch

        gpu = torch.cuda.get_device_name(0)
        versions["torch_cuda"] = torch.version.cuda
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=False, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    memory = _first_line("/proc/meminfo", "MemTotal")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(), "platform": platform.platform(),
        "cpu_model": _first_line("/proc/cpuinfo", "model name"), "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_bytes": int(memory.split()[0]) * 1024 if memory else None,
        "python": platform.python_version(), "versions": versions, "gpu": gpu, "gdsckpt_commit": commit,
        "dir": str(directory.resolve()), "filesystem": filesystem_of(directory),
    }


class Report(dict):
    """The JSON of one run (schema above). ``attempt`` runs a step and records its failure in
    ``errors`` (the others go on); ``check`` records a bit-exact comparison; ``write`` validates
    and writes the file, after every step too, so a run cut short keeps what it measured."""

    def __init__(self, benchmark: str, args: Any, directory: Path, device: str, out: Path | str):
        super().__init__(schema=SCHEMA, benchmark=benchmark, command=[Path(sys.argv[0]).name, *sys.argv[1:]],
                         args={k: v if isinstance(v, (int, float, str, bool, list, type(None))) else str(v)
                               for k, v in vars(args).items()},
                         host=host_facts(directory), device=device, state={}, results={}, limits={}, checks={},
                         bit_exact=None, errors={}, skipped={}, seconds=0.0)
        self.out = Path(out)
        self.started = time.perf_counter()

    def attempt(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args)
        except Exception as err:
            frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
            where = f" (at {Path(frame.filename).name}:{frame.lineno})" if frame else ""
            self["errors"][name] = f"{type(err).__name__}: {err}{where}"
            traceback.print_exc()
            return None
        finally:
            status = "failed" if name in self["errors"] else "done"
            print(f"[{time.perf_counter() - self.started:7.1f} s] {name} {status} "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
            self.write()

    def check(self, name: str, problems: list[str]) -> bool:
        self["checks"][name] = not problems
        if problems:
            self["errors"][f"{name}/bit_exact"] = "; ".join(problems[:5])
        return not problems

    def write(self) -> None:
        checks = self["checks"]
        self["bit_exact"] = all(checks.values()) if checks else None
        self["seconds"] = time.perf_counter() - self.started
        missing = [key for key in REQUIRED_KEYS if key not in self]
        assert not missing, f"report lacks {missing}"
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self, indent=1, default=str) + "\n")

    def finish(self) -> int:
        """Write the file, print where, and return the exit status: 1 when a check failed."""
        self.write()
        for name, reason in self["skipped"].items():
            print(f"skipped {name}: {reason}")
        for name, error in self["errors"].items():
            print(f"error {name}: {error[:300]}")
        print(f"wrote {self.out}", flush=True)
        return 1 if self["bit_exact"] is False else 0


def skip_without_cuda(report: Report) -> bool:
    """True (and the run recorded as skipped, with a message) when ``--device cuda`` meets a host
    without CUDA: a GPU benchmark then ends cleanly instead of failing."""
    if report["device"] != "cuda" or cuda_available():
        return False
    reason = "--device cuda needs CUDA (torch.cuda.is_available() is False); nothing was measured"
    report["skipped"]["all"] = reason
    print(f"skipped: {reason}", flush=True)
    return True


def run_benchmark(name: str, args: Any, run: Callable[[Report, Path], None],
                  show: Callable[[Report], None]) -> int:
    """A benchmark's whole run: a fresh directory under ``args.dir``, the report, ``run(report,
    directory)`` unless ``--device cuda`` meets a host without CUDA, ``show(report)``, the file."""
    with run_directory(args.dir, f"{name}-") as directory:
        report = Report(name, args, directory, args.device, args.out)
        if not skip_without_cuda(report):
            report.attempt("run", run, report, directory)
            show(report)
    return report.finish()


@contextlib.contextmanager
def run_directory(parent: str | Path, prefix: str) -> Iterator[Path]:
    """A fresh directory under ``parent`` for one run's files, removed afterwards (with ``parent``
    when this created it)."""
    import tempfile

    parent = Path(parent)
    created = not parent.exists()
    parent.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                parent.rmdir()


# ---------------------------------------------------------------------------------------------
# spawned ranks (also used by tests/gpu/test_dcp_nccl.py)

def spawn_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, seconds: float) -> str | None:
    """Run ``fn(rank, *args)`` on ``nprocs`` spawned processes; None when every one exited 0, else
    how the group ended. ``start_processes(join=True)`` waits forever on a rank stuck in a
    collective; this waits at most ``seconds``, then terminates (and if need be kills) every rank
    still alive. Ranks are spawned, never forked, so a parent that initialised CUDA is safe."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + seconds
    ending: str | None = None
    try:
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                ending = f"still running after {seconds} s: terminated"
                break
    except ProcessException as err:  # a rank raised or died; torch ends the others
        ending = f"{type(err).__name__}: {err}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
                    process.join(timeout=10)
    return ending
