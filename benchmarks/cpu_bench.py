#!/usr/bin/env python3
"""CPU benchmark: gdsckpt next to torch.save/torch.load and safetensors on one training state.

Builds a GPT-style model (``gdsckpt.demo.TinyGPT``) sized to ``--size``, trains it a few steps
with AdamW on random tokens and assembles a mixed-precision training state from it:

- ``model_bf16``: the weights as bf16 (the copy a mixed-precision step computes with),
- ``master``: the fp32 master weights (``model.state_dict()``),
- ``optimizer``: AdamW's state (fp32 ``exp_avg`` / ``exp_avg_sq`` and ``step`` per parameter),
- ``step``: an int.

so the bytes are ~14% bf16 and ~86% fp32, like a real checkpoint. Then, in one process and on
the same data, each method saves durably (fsync) and loads cold (the file is dropped from the
page cache before every read), and every load is compared bit for bit with the original:

- ``gdsckpt/<variant>``: ``gdsckpt.save`` / ``gdsckpt.load`` with the codec of the variant
  (defaults: none, lz4, zstd, auto; add more with ``--variant label=codec,key=value,...``, where
  keys are ``gdsckpt.Config`` fields, e.g. ``--variant auto-L3=auto,level=3``),
- ``torch``: ``torch.save`` + flush + fsync, ``torch.load(weights_only=True)``,
- ``safetensors``: ``save_file`` + fsync, ``load_file`` (of the state flattened to a dict of
  tensors).

MB/s is logical tensor bytes (1 MB = 10**6 bytes) over wall seconds; ratio is logical bytes over
file bytes. A second section (``--normal-size``, 0 to skip) saves N(0, 0.02) data as bf16 and
as fp32 with codec auto and reports the ratio of each. Results go to a JSON file (default
``benchmarks/results/cpu-<date>.json``) and a short table is printed.

Usage::

    python3 benchmarks/cpu_bench.py --size 1GiB --dir /tmp/bench --repeat 3
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import gdsckpt  # noqa: E402
from gdsckpt.config import Config, parse_size  # noqa: E402
from gdsckpt.demo import TinyGPT, bit_equal, train_steps  # noqa: E402

MB = 1e6
DEFAULT_VARIANTS = ("none=none", "lz4=lz4", "zstd=zstd", "auto=auto")


# ---------------------------------------------------------------------------------------------
# the training state

def gpt_shape(target_bytes: int) -> dict[str, int]:
    """Vocab, width and depth of a TinyGPT whose mixed-precision state is about ``target_bytes``.

    Bytes per parameter: 2 (bf16 copy) + 4 (fp32 master) + 4 + 4 (AdamW moments) = 14.
    """
    params = max(1, target_bytes // 14)
    vocab = 8192 if target_bytes >= 256 << 20 else 1024
    context = 64
    best = None
    for width in (64, 128, 192, 256, 384, 512, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096):
        fixed = 2 * vocab * width + context * width + 2 * width
        per_block = 12 * width * width + 13 * width
        depth = max(1, round((params - fixed) / per_block))
        total = fixed + depth * per_block
        best = {"vocab": vocab, "width": width, "depth": depth, "params": total}
        if depth <= 12:
            break
    assert best is not None
    return best


def build_state(target_bytes: int, *, steps: int, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The mixed-precision training state and a description of how it was made."""
    shape = gpt_shape(target_bytes)
    torch.manual_seed(seed)
    heads = max(1, shape["width"] // 64)
    model = TinyGPT(vocab=shape["vocab"], width=shape["width"], depth=shape["depth"], heads=heads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    started = time.perf_counter()
    loss = train_steps(model, optimizer, steps, seed=seed)
    train_seconds = time.perf_counter() - started
    master = model.state_dict()
    state = {
        "model_bf16": {key: value.detach().to(torch.bfloat16) for key, value in master.items()},
        "master": master,
        "optimizer": optimizer.state_dict(),
        "step": steps,
    }
    info = dict(shape, heads=heads, train_steps=steps, train_seconds=round(train_seconds, 3),
                last_loss=loss, seed=seed)
    return state, info


def flatten(obj: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and plain leaves of a nested state, keyed by ``a/b/c`` paths."""
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, Any] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            tensors[path] = node
        elif isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}/{key}" if path else str(key))
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(value, f"{path}/{i}" if path else str(i))
        else:
            plain[path] = node

    walk(obj, prefix)
    return tensors, plain


def dtype_bytes(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tensor in tensors.values():
        name = str(tensor.dtype).replace("torch.", "")
        counts[name] = counts.get(name, 0) + tensor.numel() * tensor.element_size()
    return counts


def compare(original: tuple[dict[str, torch.Tensor], dict[str, Any]], loaded: Any, *,
            tensors_only: bool = False) -> list[str]:
    """Differences between the original (flattened) and a loaded state; empty when bit-exact."""
    want_tensors, want_plain = original
    got_tensors, got_plain = loaded if isinstance(loaded, tuple) else flatten(loaded)
    problems = []
    if set(want_tensors) != set(got_tensors):
        missing = sorted(set(want_tensors) - set(got_tensors))[:3]
        extra = sorted(set(got_tensors) - set(want_tensors))[:3]
        problems.append(f"tensor keys differ (missing {missing}, extra {extra})")
    for key, tensor in want_tensors.items():
        other = got_tensors.get(key)
        if other is not None and not bit_equal(tensor, other):
            problems.append(f"{key}: not bit-equal")
    if not tensors_only:
        for key, value in want_plain.items():
            if key not in got_plain or got_plain[key] != value or type(got_plain[key]) is not type(value):
                problems.append(f"{key}: plain value {got_plain.get(key)!r} != {value!r}")
    return problems


# ---------------------------------------------------------------------------------------------
# cold reads

def _try_drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def make_cold(path: Path, method: str) -> None:
    """Push ``path`` out of the page cache: fsync it, fadvise DONTNEED, and drop_caches if used."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if method != "none":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if method == "drop_caches+fadvise":
        _try_drop_caches()


def resolve_cold_method(requested: str) -> str:
    if requested == "auto":
        return "drop_caches+fadvise" if _try_drop_caches() else "fadvise"
    if requested == "drop_caches" and not _try_drop_caches():
        raise SystemExit("--cold drop_caches: cannot write /proc/sys/vm/drop_caches (needs root)")
    return {"drop_caches": "drop_caches+fadvise"}.get(requested, requested)


# ---------------------------------------------------------------------------------------------
# methods

@dataclasses.dataclass
class Method:
    label: str
    save: Callable[[Any, Path], dict[str, Any]]
    load: Callable[[Path], Any]
    suffix: str
    tensors_only: bool = False
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    compare: Callable[[Any], list[str]] | None = None


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_method() -> Method:
    def save(state: Any, path: Path) -> dict[str, Any]:
        with path.open("wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        return {}

    def load(path: Path) -> Any:
        return torch.load(path, map_location="cpu", weights_only=True)

    return Method("torch", save, load, ".pt")


def _touch_pages(tensors: dict[str, torch.Tensor]) -> None:
    """Read one byte of every 4 KiB page, so memory-mapped tensors are really in memory."""
    for tensor in tensors.values():
        if tensor.numel():
            flat = tensor.detach().reshape(-1).view(torch.uint8)
            int(flat[::4096].sum())


def safetensors_methods() -> list[Method]:
    """safetensors' default (mmap: tensors map the file, so the timed load touches every page to
    fault the bytes in, as a full read would) and its eager ``pread`` backend where available."""
    try:
        import inspect as _inspect

        from safetensors.torch import load_file, save_file
    except ImportError:
        return []

    def save(state: Any, path: Path) -> dict[str, Any]:
        tensors, plain = flatten(state)
        tensors = {key: value.contiguous() for key, value in tensors.items()}
        save_file(tensors, str(path), metadata={"plain": json.dumps(plain, default=str)})
        _fsync_path(path)
        return {}

    def load_mmap(path: Path) -> Any:
        tensors = load_file(str(path), device="cpu")
        _touch_pages(tensors)
        return tensors, {}

    methods = [Method("safetensors", save, load_mmap, ".safetensors", tensors_only=True,
                      settings={"load": "mmap + touch every page"})]
    if "backend" in _inspect.signature(load_file).parameters:
        def load_pread(path: Path) -> Any:
            return load_file(str(path), device="cpu", backend="pread"), {}

        methods.append(Method("safetensors-pread", save, load_pread, ".safetensors", tensors_only=True,
                              settings={"load": "backend=pread"}))
    return methods


def disk_method(logical: int) -> Method:
    """What the disk alone does with the same number of bytes: one buffered write + fsync, one
    cold read into a preallocated buffer (no serialization, no checks beyond a byte compare)."""
    import numpy as np

    source = np.random.default_rng(0).integers(0, 256, logical, dtype=np.uint8)
    block = 8 << 20

    def save(_state: Any, path: Path) -> dict[str, Any]:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(source)
            for start in range(0, logical, block):
                os.write(fd, view[start:start + block])
            os.fsync(fd)
        finally:
            os.close(fd)
        return {}

    def load(path: Path) -> Any:
        out = np.empty(logical, dtype=np.uint8)
        with open(path, "rb", buffering=0) as handle:
            handle.readinto(memoryview(out))
        return out

    return Method("disk (raw bytes)", save, load, ".bin", settings={"block": block},
                  compare=lambda loaded: [] if np.array_equal(loaded, source) else ["bytes differ"])


def gdsckpt_method(label: str, codec: str, config: Config) -> Method:
    def save(state: Any, path: Path) -> dict[str, Any]:
        report = gdsckpt.save(state, path, codec=codec, config=config)
        return {"codec": report.codec, "backend": report.backend, "engine": report.engine,
                "chunks": report.chunks, "chains": report.chains,
                "stored_bytes": report.stored_bytes, "gdsckpt_logical_bytes": report.logical_bytes}

    def load(path: Path) -> Any:
        return gdsckpt.load(path, config=config)

    settings = {"codec": codec, **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}}
    return Method(f"gdsckpt/{label}", save, load, ".gdsckpt", settings=settings)


def parse_variant(text: str, base: Config) -> tuple[str, str, Config]:
    """``label=codec[,key=value...]`` -> (label, codec, config)."""
    label, _, spec = text.partition("=")
    if not spec:
        label, spec = text, text
    codec, *pairs = spec.split(",")
    changes: dict[str, Any] = {}
    from gdsckpt.config import _coerce

    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in {f.name for f in dataclasses.fields(Config)}:
            raise SystemExit(f"--variant {text!r}: {key!r} is not a gdsckpt.Config field")
        changes[key] = _coerce(key, value)
    return label, codec, base.replace(**changes) if changes else base


def _busy_seconds() -> float | None:
    """CPU seconds all processes of the host have spent busy (from /proc/stat), or None."""
    try:
        with open("/proc/stat") as handle:
            fields = [int(x) for x in handle.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class _Meter:
    """Wall seconds, this process's CPU seconds (all threads) and other processes' CPU seconds
    over a block: the last shows whether something else competed for the cores."""

    def __enter__(self) -> _Meter:
        self.busy0, self.cpu0, self.wall0 = _busy_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0
        busy = _busy_seconds()
        self.others = None if busy is None or self.busy0 is None else max(0.0, busy - self.busy0 - self.cpu)


def run_once(method: Method, state: Any, original: Any, logical: int, directory: Path,
             cold: str) -> tuple[dict[str, Any], dict[str, Any], int, list[str]]:
    """One durable save and one cold load; returns (sample, save details, file bytes, problems)."""
    path = directory / f"bench-{method.label.replace('/', '-').replace(' ', '_')}{method.suffix}"
    path.unlink(missing_ok=True)
    os.sync()
    gc.collect()
    with _Meter() as save_meter:
        details = method.save(state, path)
    file_bytes = path.stat().st_size
    make_cold(path, cold)
    gc.collect()
    with _Meter() as load_meter:
        loaded = method.load(path)
    if method.compare is not None:
        problems = method.compare(loaded)
    else:
        problems = compare(original, loaded, tensors_only=method.tensors_only)
    del loaded
    path.unlink(missing_ok=True)
    sample = {"save_s": save_meter.wall, "load_s": load_meter.wall,
              "save_mb_s": logical / MB / save_meter.wall, "load_mb_s": logical / MB / load_meter.wall,
              "save_cpu_s_per_gb": save_meter.cpu / (logical / 1e9),
              "load_cpu_s_per_gb": load_meter.cpu / (logical / 1e9),
              "save_other_cpu_s": save_meter.others, "load_other_cpu_s": load_meter.others,
              "bit_exact": not problems}
    return sample, details, file_bytes, problems


def summarize(method: Method, runs: list[tuple[dict[str, Any], dict[str, Any], int, list[str]]],
              logical: int) -> dict[str, Any]:
    samples = [run[0] for run in runs]
    details, file_bytes = runs[-1][1], runs[-1][2]
    problems = next((run[3] for run in runs if run[3]), [])
    return {
        "method": method.label, "settings": method.settings, "file_bytes": file_bytes,
        "ratio": logical / file_bytes, "samples": samples,
        "save_mb_s": statistics.median(s["save_mb_s"] for s in samples),
        "load_mb_s": statistics.median(s["load_mb_s"] for s in samples),
        "save_mb_s_best": max(s["save_mb_s"] for s in samples),
        "load_mb_s_best": max(s["load_mb_s"] for s in samples),
        "save_cpu_s_per_gb": statistics.median(s["save_cpu_s_per_gb"] for s in samples),
        "load_cpu_s_per_gb": statistics.median(s["load_cpu_s_per_gb"] for s in samples),
        "bit_exact": all(s["bit_exact"] for s in samples), "problems": problems[:10], **details,
    }


def run_methods(methods: list[Method], state: Any, original: Any, logical: int, directory: Path, cold: str,
                repeat: int, verbose: bool = True) -> list[dict[str, Any]]:
    """Round-robin: every method once per round, so slow phases of a noisy disk hit all of them."""
    runs: dict[str, list[Any]] = {m.label: [] for m in methods}
    for round_number in range(repeat):
        for method in methods:
            run = run_once(method, state, original, logical, directory, cold)
            runs[method.label].append(run)
            if verbose:
                sample = run[0]
                others = [sample[k] for k in ("save_other_cpu_s", "load_other_cpu_s")]
                print(f"  [{round_number + 1}/{repeat}] {method.label:30} ratio {logical / run[2]:.3f}  "
                      f"save {sample['save_mb_s']:6.0f} MB/s  load {sample['load_mb_s']:6.0f} MB/s  "
                      f"(other processes' CPU s: {'/'.join('?' if x is None else f'{x:.1f}' for x in others)})  "
                      f"bit-exact {'yes' if sample['bit_exact'] else 'NO ' + '; '.join(run[3][:3])}", flush=True)
    return [summarize(m, runs[m.label], logical) for m in methods]


def normal_section(nbytes: int, directory: Path, cold: str, config: Config, repeat: int) -> list[dict[str, Any]]:
    """Ratio (and speed) of codec auto on N(0, 0.02) data stored as bf16 and as fp32."""
    results = []
    generator = torch.Generator().manual_seed(1234)
    for dtype in (torch.bfloat16, torch.float32):
        count = nbytes // torch.tensor([], dtype=dtype).element_size()
        data = (torch.randn(count, generator=generator) * 0.02).to(dtype)
        state = {"weights": data}
        original = flatten(state)
        method = gdsckpt_method(f"auto-normal-{str(dtype).replace('torch.', '')}", "auto", config)
        result = run_methods([method], state, original, data.numel() * data.element_size(), directory, cold,
                             repeat)[0]
        result["dtype"] = str(dtype).replace("torch.", "")
        result["logical_bytes"] = data.numel() * data.element_size()
        results.append(result)
        del data, state, original
        gc.collect()
    return results


# ---------------------------------------------------------------------------------------------
# host description

def filesystem_of(directory: Path) -> dict[str, str]:
    real = str(directory.resolve())
    best = {"mount_point": "?", "type": "?", "device": "?", "options": ""}
    try:
        with open("/proc/mounts") as handle:
            for line in handle:
                device, mount_point, fstype, options, *_ = line.split()
                mount_point = mount_point.replace("\\040", " ")
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best["mount_point"].replace("?", "")):
                    best = {"mount_point": mount_point, "type": fstype, "device": device, "options": options}
    except OSError:
        pass
    return best


def _version(module: str) -> str | None:
    try:
        return str(__import__(module).__version__)
    except Exception:
        return None


def host_info(directory: Path) -> dict[str, Any]:
    cpu_model = None
    try:
        with open("/proc/cpuinfo") as handle:
            cpu_model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")),
                             None)
    except OSError:
        pass
    mem_total = None
    try:
        with open("/proc/meminfo") as handle:
            mem_total = next(int(line.split()[1]) * 1024 for line in handle if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(), "platform": platform.platform(), "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_bytes": mem_total, "python": platform.python_version(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "numpy": _version("numpy"),
        "zstandard": _version("zstandard"), "lz4": _version("lz4"), "safetensors": _version("safetensors"),
        "crc32c": _version("crc32c"), "gdsckpt": gdsckpt.__version__, "gdsckpt_commit": commit,
        "dir": str(directory.resolve()), "filesystem": filesystem_of(directory),
    }


# ---------------------------------------------------------------------------------------------
# main

def print_table(title: str, rows: list[dict[str, Any]], baseline: dict[str, Any] | None) -> None:
    print(title)
    print(f"  {'method':30}{'ratio':>7}{'save MB/s':>11}{'load MB/s':>11}{'save x':>8}{'load x':>8}"
          f"{'save cpu':>10}{'load cpu':>10}  bit-exact")
    for row in rows:
        save_x = f"{row['save_mb_s'] / baseline['save_mb_s']:.2f}" if baseline else "-"
        load_x = f"{row['load_mb_s'] / baseline['load_mb_s']:.2f}" if baseline else "-"
        print(f"  {row['method']:30}{row['ratio']:>7.3f}{row['save_mb_s']:>11.0f}{row['load_mb_s']:>11.0f}"
              f"{save_x:>8}{load_x:>8}{row['save_cpu_s_per_gb']:>10.2f}{row['load_cpu_s_per_gb']:>10.2f}"
              f"  {'yes' if row['bit_exact'] else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1GiB", help="target size of the training state (default 1GiB)")
    parser.add_argument("--dir", default=None, help="directory for the files (default: a temp dir in /tmp)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/cpu-<date>.json)")
    parser.add_argument("--repeat", type=int, default=1, help="save+load rounds per method (median reported)")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps before saving (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", action="append", default=None,
                        help="gdsckpt variant label=codec[,key=value...] (repeatable; replaces the defaults "
                             f"{', '.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--extra-variant", action="append", default=[],
                        help="a variant added to the defaults (same syntax as --variant)")
    parser.add_argument("--no-baselines", action="store_true", help="skip disk, torch and safetensors")
    parser.add_argument("--normal-size", default="256MiB",
                        help="bytes of N(0,0.02) data per dtype (bf16, fp32) for the ratio section; 0 skips")
    parser.add_argument("--cold", choices=("auto", "drop_caches", "fadvise", "none"), default="auto",
                        help="how to make reads cold (auto: drop_caches when writable, plus fadvise)")
    args = parser.parse_args(argv)

    size = parse_size(args.size)
    normal_size = parse_size(args.normal_size)
    if args.dir:
        directory = Path(args.dir)
        directory.mkdir(parents=True, exist_ok=True)
    else:
        import tempfile

        directory = Path(tempfile.mkdtemp(prefix="gdsckpt-bench-"))
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"cpu-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cold = resolve_cold_method(args.cold)
    base = Config.from_env()

    state, model_info = build_state(size, steps=args.steps, seed=args.seed)
    original = flatten(state)
    logical = sum(t.numel() * t.element_size() for t in original[0].values())
    by_dtype = dtype_bytes(original[0])
    print(f"state: TinyGPT vocab={model_info['vocab']} width={model_info['width']} depth={model_info['depth']} "
          f"({model_info['params'] / 1e6:.1f}M params) + bf16 copy + AdamW: {logical / MB:.1f} MB in "
          f"{len(original[0])} tensors ({', '.join(f'{k} {v / logical:.0%}' for k, v in by_dtype.items())}); "
          f"dir {directory} ({filesystem_of(directory)['type']}); cold reads: {cold}", flush=True)

    methods: list[Method] = []
    if not args.no_baselines:
        methods.append(disk_method(logical))
        methods.append(torch_method())
        methods.extend(safetensors_methods())
    for text in (args.variant or list(DEFAULT_VARIANTS)) + args.extra_variant:
        label, codec, config = parse_variant(text, base)
        methods.append(gdsckpt_method(label, codec, config))

    results = run_methods(methods, state, original, logical, directory, cold, args.repeat)

    del state
    gc.collect()
    normal = normal_section(normal_size, directory, cold, base, args.repeat) if normal_size else []

    report = {
        "benchmark": "cpu_bench", "args": vars(args), "host": host_info(directory), "cold_method": cold,
        "state": dict(model_info, logical_bytes=logical, tensors=len(original[0]), bytes_by_dtype=by_dtype),
        "config_defaults": {f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
        "results": results, "normal": normal,
        "all_bit_exact": all(r["bit_exact"] for r in results + normal),
    }
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    baseline = next((r for r in results if r["method"] == "torch"), None)
    print()
    print_table(f"{logical / MB:.0f} MB training state, {report['host']['cpu_affinity']} cores, "
                f"{report['host']['filesystem']['type']}, cold reads by {cold}, median of {args.repeat}"
                + (" (x: relative to torch; cpu: this process's CPU s per GB)" if baseline else ""),
                results, baseline)
    if normal:
        print_table(f"N(0, 0.02) data, {normal_size / MB:.0f} MB per dtype, codec auto", normal, None)
    print(f"\nwrote {out}")
    return 0 if report["all_bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
