"""Save/load benchmark, both engines: gdsckpt next to the storage's raw speed, torch.save/load,
safetensors, DCP and (on the GPU) nvCOMP-per-tensor + torch.save, on one training state, one run.

The state (``benchlib.build_state``): a ``gdsckpt.demo.TinyGPT`` trained ``--steps`` AdamW steps on
random tokens, saved as bf16 weights + fp32 master weights + exp_avg + exp_avg_sq, on ``--device``
(``cuda``: the GPU engine, nvCOMP + kvikio; ``cpu``: the CPU engine). In one process and on the same
data, each method saves durably (fsync inside the timing) and loads cold (every file fsynced and
dropped from the page cache with posix_fadvise(DONTNEED) before the read), round-robin for
``--repeat`` rounds so that a slow phase of the disk hits every method; every load is compared bit
for bit with the source. GB/s is logical tensor bytes (10**9) over wall seconds; ratio is logical
bytes over bytes on disk.

- ``raw``: the same bytes written (+fsync) and read cold with no format (kvikio on the GPU,
  ``os.write`` / ``readinto`` on the CPU): the limit. ``limits`` puts each gdsckpt figure next to
  ratio x raw of the same run;
- ``gdsckpt/<label>``: ``gdsckpt.save`` / ``gdsckpt.load`` per ``--variant label=codec[,field=value]``
  (fields of ``gdsckpt.Config``; default: ``auto`` on the GPU; none, lz4, zstd, auto on the CPU);
- ``torch``: ``torch.save`` + fsync / ``torch.load(weights_only=True)`` onto the device;
- ``--baselines``: ``safetensors``, ``dcp`` (FileSystemWriter), ``dcp_zstd`` (its ZStandard
  extension), ``naive_nvcomp_torch`` (GPU only: nvCOMP ANS per tensor, then torch.save).

On the GPU the first gdsckpt variant's save and load also sample device memory beyond the state
and host RSS growth (needs CuPy and psutil). With ``--device cuda`` on a host without CUDA the run
is recorded as skipped and exits 0.

    python3 benchmarks/save_load_bench.py --device cuda --width 2560 --depth 8 --dir /root/bench --out gpu.json
    python3 benchmarks/save_load_bench.py --device cpu --size 1GiB --repeat 5 --out cpu.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import benchlib

GPU_BASELINES = ("naive_nvcomp_torch",)


@dataclass
class Method:
    name: str
    save: Callable[[Path], Any]
    load: Callable[[Path], Any]
    suffix: str
    compare: Callable[[Any], list[str]]
    details: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# methods

def transfer_all(call: Callable[..., Any], buffers: list[Any]) -> None:
    """kvikio ``pwrite`` / ``pread`` of ``buffers`` back to back from offset 0, all in flight at once."""
    offset, futures = 0, []
    for buffer in buffers:
        futures.append(call(buffer, buffer.numel(), offset))
        offset += buffer.numel()
    for future in futures:
        future.get()


def raw_method(state: dict, device: str) -> Method:
    """The same bytes with no format: the storage's own speed for this amount of data."""
    import torch

    tensors = list(benchlib.flatten(state)[0].values())
    views = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
    if device == "cuda":
        import kvikio

        def save(path: Path) -> None:
            with kvikio.CuFile(path, "w") as handle:
                transfer_all(handle.pwrite, views)
            benchlib.fsync_tree(path)

        def load(path: Path) -> list[Any]:
            out = [torch.empty_like(v) for v in views]
            with kvikio.CuFile(path, "r") as handle:
                transfer_all(handle.pread, out)
            return out
    else:
        def save(path: Path) -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for view in views:
                    data = memoryview(view.numpy())
                    while data:
                        data = data[os.write(fd, data):]
                os.fsync(fd)
            finally:
                os.close(fd)

        def load(path: Path) -> list[Any]:
            out = [torch.empty_like(v) for v in views]
            with open(path, "rb", buffering=0) as handle:
                for buffer in out:
                    handle.readinto(memoryview(buffer.numpy()))
            return out

    def compare(loaded: list[Any]) -> list[str]:
        return [] if all(torch.equal(a, b) for a, b in zip(views, loaded)) else ["raw bytes differ"]

    return Method("raw", save, load, ".bin", compare, {"io": "kvikio" if device == "cuda" else "posix"})


def gdsckpt_method(label: str, spec: str, state: dict, device: str, reports: dict) -> Method:
    import gdsckpt

    codec, _, fields = spec.partition(",")
    config = benchlib.config_variant(fields)

    def save(path: Path) -> None:
        reports[label] = gdsckpt.save(state, path, codec=codec, config=config)

    def load(path: Path) -> Any:
        return gdsckpt.load(path, device=device, config=config)

    return Method(f"gdsckpt/{label}", save, load, ".gdsckpt", lambda got: benchlib.differences(state, got),
                  {"codec": codec, "config": benchlib.config_dict(config)})


def torch_method(state: dict, device: str) -> Method:
    import torch

    return Method("torch", lambda path: benchlib.durable_torch_save(state, path),
                  lambda path: torch.load(path, map_location=device, weights_only=True), ".pt",
                  lambda got: benchlib.differences(state, got))


def safetensors_method(state: dict, device: str) -> Method:
    import torch
    from safetensors.torch import load_file, save_file

    flat = benchlib.flatten(state)[0]

    def save(path: Path) -> None:
        save_file({k: v.contiguous() for k, v in flat.items()}, str(path))
        benchlib.fsync_tree(path)

    def load(path: Path) -> Any:
        tensors = load_file(str(path), device=device)
        if device == "cpu":  # tensors map the file: touch every page, as a full read would
            for tensor in tensors.values():
                if tensor.numel():
                    int(tensor.reshape(-1).view(torch.uint8)[::4096].sum())
        return tensors

    return Method("safetensors", save, load, ".safetensors",
                  lambda got: benchlib.differences((flat, {}), (got, {})))


def dcp_method(state: dict, *, zstd: bool) -> Method:
    import torch
    import torch.distributed.checkpoint as dcp

    flat = {k.replace("/", "."): v for k, v in benchlib.flatten(state)[0].items()}

    def save(path: Path) -> None:
        kwargs: dict[str, Any] = {}
        if zstd:
            from torch.distributed.checkpoint._extension import ZStandard  # torch's, not gdsckpt's

            kwargs["_extensions"] = [ZStandard()]
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True, **kwargs))

    def load(path: Path) -> Any:
        template = {k: torch.zeros_like(v) for k, v in flat.items()}
        dcp.load(template, storage_reader=dcp.FileSystemReader(str(path)))
        return template

    return Method("dcp_zstd" if zstd else "dcp", save, load, "",
                  lambda got: benchlib.differences((flat, {}), (got, {})))


def naive_method(state: dict) -> Method:
    """The do-it-yourself approach: nvCOMP ANS per tensor, then torch.save of the buffers."""
    import cupy
    import torch
    from nvidia import nvcomp

    flat = benchlib.flatten(state)[0]

    def save(path: Path) -> None:
        codec = nvcomp.Codec(algorithm="ANS")
        encoded = {}
        for key, tensor in flat.items():
            array = codec.encode(nvcomp.as_array(cupy.asarray(tensor.reshape(-1).view(torch.uint8))))
            data = torch.from_dlpack(array).view(torch.uint8).reshape(-1)[: array.buffer_size].clone()
            encoded[key] = (data, str(tensor.dtype), tuple(tensor.shape))
        benchlib.durable_torch_save(encoded, path)

    def load(path: Path) -> Any:
        codec = nvcomp.Codec(algorithm="ANS")
        encoded = torch.load(path, map_location="cuda", weights_only=True)
        out = {}
        for key, (data, _dtype, _shape) in encoded.items():
            decoded = torch.from_dlpack(codec.decode(nvcomp.as_array(cupy.asarray(data))))
            out[key] = decoded.view(torch.uint8).reshape(-1)[: flat[key].numel() * flat[key].element_size()].clone()
        return out

    def compare(got: dict) -> list[str]:
        return [k for k, t in flat.items() if not torch.equal(t.reshape(-1).view(torch.uint8), got[k])]

    return Method("naive_nvcomp_torch", save, load, ".pt", compare)


# ---------------------------------------------------------------------------------------------
# memory beyond the state (GPU)

class MemorySampler:
    """Peak device memory in use (device-wide, over the value at entry; nvCOMP's own allocations
    count), CuPy's pool and torch's reserved memory, and host RSS growth, sampled every 2 ms."""

    def __enter__(self) -> MemorySampler:
        import cupy
        import psutil
        import torch

        torch.cuda.empty_cache()  # cached blocks of earlier steps would hide this step's use
        cupy.get_default_memory_pool().free_all_blocks()
        self._process = psutil.Process()
        self._free0 = torch.cuda.mem_get_info()[0]
        self._rss0 = self._process.memory_info().rss
        self._reserved0 = torch.cuda.memory_reserved()
        self.gpu_peak = self.rss_peak = self.cupy_peak = self.torch_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        import cupy
        import torch

        self.gpu_peak = max(self.gpu_peak, self._free0 - torch.cuda.mem_get_info()[0])
        self.cupy_peak = max(self.cupy_peak, cupy.get_default_memory_pool().total_bytes())
        self.torch_peak = max(self.torch_peak, torch.cuda.memory_reserved() - self._reserved0)
        self.rss_peak = max(self.rss_peak, self._process.memory_info().rss - self._rss0)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self._sample()

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.cuda.synchronize()
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()
        # tensors restored into torch's allocator are the state itself, not the pipeline's overhead
        self.torch_growth = torch.cuda.memory_reserved() - self._reserved0

    def figures(self, *, restored: bool) -> dict[str, int]:
        beyond = self.gpu_peak - (self.torch_growth if restored else 0)
        return {"gpu_bytes_beyond_state": beyond, "cupy_pool_peak": self.cupy_peak,
                "torch_reserved_peak": self.torch_peak, "host_rss_growth": self.rss_peak}


def can_sample_memory() -> bool:
    try:
        import cupy  # noqa: F401
        import psutil  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# the run

def one_round(method: Method, directory: Path, logical: int, device: str, report: benchlib.Report,
              memory: dict | None) -> dict[str, Any]:
    path = directory / f"{method.name.replace('/', '-')}{method.suffix}"
    benchlib.remove(path)
    gc.collect()
    sampler = MemorySampler() if memory is not None else None
    with sampler or _Nothing():
        save_s = benchlib.timed(lambda: method.save(path), device)
    if sampler is not None:
        memory["save"] = sampler.figures(restored=False)
    file_bytes = benchlib.disk_bytes(path)
    benchlib.make_cold(path, drop_caches=report["args"]["drop_caches"])
    gc.collect()
    loaded: list[Any] = []
    sampler = MemorySampler() if memory is not None else None
    with sampler or _Nothing():
        load_s = benchlib.timed(lambda: loaded.append(method.load(path)), device)
    if sampler is not None:
        memory["load"] = sampler.figures(restored=True)
    problems = method.compare(loaded.pop())
    benchlib.remove(path)
    return {"save_s": save_s, "load_s": load_s, "save_gbps": logical / save_s / 1e9,
            "load_gbps": logical / load_s / 1e9, "file_bytes": file_bytes, "problems": problems[:5]}


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def group_ratios(path: Path) -> dict[str, float]:
    """Ratio per group: top-level key, and each optimizer moment on its own."""
    import gdsckpt

    groups: dict[str, list[int]] = {}
    for tensor in gdsckpt.inspect(path).tensors:
        parts = tensor.key.split("/")
        group = parts[0] if parts[0] != "optimizer" else f"optimizer/{parts[-1]}"
        entry = groups.setdefault(group, [0, 0])
        entry[0] += tensor.nbytes
        entry[1] += tensor.stored_bytes
    return {g: raw / stored for g, (raw, stored) in groups.items() if stored}


def run(args: argparse.Namespace, report: benchlib.Report, directory: Path) -> None:
    device = args.device
    if args.size:
        args.width, args.depth = benchlib.shape_for_bytes(benchlib.parse_size(args.size))
    state = report.attempt("build", benchlib.build_state, args.width, args.depth, args.steps, device)
    if state is None:
        return
    logical = benchlib.logical_bytes(state)
    report["state"] = benchlib.describe_state(state, width=args.width, depth=args.depth, steps=args.steps)
    benchlib.warm_up(directory, device)

    reports: dict[str, Any] = {}
    methods = [raw_method(state, device)] if device == "cpu" or _has("kvikio") else []
    if not methods:
        report["skipped"]["raw"] = "kvikio is not installed"
    cpu_variants = ["none=none", "lz4=lz4", "zstd=zstd", "auto=auto"]
    variants = args.variant or (["auto=auto"] if device == "cuda" else cpu_variants)
    for text in variants:
        label, _, spec = text.partition("=")
        methods.append(gdsckpt_method(label, spec or label, state, device, reports))
    methods.append(torch_method(state, device))
    chosen = [] if args.skip_baselines else [b for b in args.baselines.split(",") if b and b != "none"]
    for name in chosen:
        if name in GPU_BASELINES and device != "cuda":
            report["skipped"][name] = "needs CUDA"
            continue
        make = {"safetensors": lambda: safetensors_method(state, device),
                "dcp": lambda: dcp_method(state, zstd=False), "dcp_zstd": lambda: dcp_method(state, zstd=True),
                "naive_nvcomp_torch": lambda: naive_method(state)}.get(name)
        if make is None:
            report["skipped"][name] = "unknown baseline"
            continue
        method = report.attempt(f"{name}/setup", make)
        if method is not None:
            methods.append(method)

    samples: dict[str, list[dict]] = {m.name: [] for m in methods}
    memory: dict[str, Any] = {}
    first_gdsckpt = next(m.name for m in methods if m.name.startswith("gdsckpt/"))
    sample_memory = device == "cuda" and can_sample_memory()
    if device == "cuda" and not sample_memory:
        report["skipped"]["memory"] = "needs CuPy and psutil"
    for round_number in range(args.repeat):
        for method in methods:
            sampled = memory if sample_memory and round_number == 0 and method.name == first_gdsckpt else None
            row = report.attempt(f"{method.name}/round{round_number + 1}", one_round, method, directory, logical,
                                 device, report, sampled)
            if row is not None:
                samples[method.name].append(row)
                print(f"  {method.name:24} ratio {logical / row['file_bytes']:6.3f}  save {row['save_gbps']:7.3f} "
                      f"GB/s  load {row['load_gbps']:7.3f} GB/s", flush=True)

    results: dict[str, Any] = {}
    for method in methods:
        rows = samples[method.name]
        if not rows:
            continue
        report.check(method.name, next((r["problems"] for r in rows if r["problems"]), []))
        results[method.name] = {
            "ratio": logical / rows[-1]["file_bytes"], "file_bytes": rows[-1]["file_bytes"],
            "save_gbps": benchlib.median([r["save_gbps"] for r in rows]),
            "load_gbps": benchlib.median([r["load_gbps"] for r in rows]), "samples": rows, **method.details}
    for label, saved in reports.items():
        entry = results.get(f"gdsckpt/{label}")
        if entry is not None:
            entry.update(codec_used=saved.codec, engine=saved.engine, backend=saved.backend, chains=saved.chains,
                         auto=saved.auto)
    report["results"] = results
    if memory:
        report["results"]["memory"] = {**memory, "method": first_gdsckpt}
    # group ratios of the first variant, from a file of its own
    first = next(m for m in methods if m.name == first_gdsckpt)
    ratios_path = directory / "groups.gdsckpt"
    report.attempt("group_ratios", lambda: (first.save(ratios_path),
                                            results.setdefault(first_gdsckpt, {}).__setitem__(
                                                "group_ratios", group_ratios(ratios_path))))
    benchlib.remove(ratios_path)
    report["limits"] = limits(results)


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def limits(results: dict[str, Any]) -> dict[str, Any]:
    """Each gdsckpt variant against ratio x raw of the same run (what a format that only moves
    fewer bytes could reach) and against torch.save/torch.load."""
    raw, ours, torch_row = results.get("raw"), {}, results.get("torch")
    for name, row in results.items():
        if not name.startswith("gdsckpt/") or "save_gbps" not in row:
            continue
        entry: dict[str, Any] = {"ratio": row["ratio"], "save_gbps": row["save_gbps"], "load_gbps": row["load_gbps"]}
        if raw:
            entry["raw_write_gbps"], entry["raw_read_gbps"] = raw["save_gbps"], raw["load_gbps"]
            entry["save_limit_gbps"] = row["ratio"] * raw["save_gbps"]
            entry["load_limit_gbps"] = row["ratio"] * raw["load_gbps"]
            entry["save_of_limit"] = row["save_gbps"] / entry["save_limit_gbps"]
            entry["load_of_limit"] = row["load_gbps"] / entry["load_limit_gbps"]
        if torch_row:
            entry["save_x_torch"] = row["save_gbps"] / torch_row["save_gbps"]
            entry["load_x_torch"] = row["load_gbps"] / torch_row["load_gbps"]
        ours[name] = entry
    return ours


def print_table(report: benchlib.Report) -> None:
    state = report["state"]
    print(f"state {state.get('logical_bytes', 0) / 2**30:.2f} GiB on {report['device']} "
          f"({report['host']['gpu'] or 'no GPU'}), median of {report['args']['repeat']}")
    print(f"  {'method':24}{'ratio':>8}{'save GB/s':>11}{'load GB/s':>11}")
    for name, row in report["results"].items():
        if "save_gbps" in row:
            print(f"  {name:24}{row['ratio']:8.3f}{row['save_gbps']:11.3f}{row['load_gbps']:11.3f}")
    for name, entry in report["limits"].items():
        if "save_of_limit" in entry:
            print(f"  {name}: save {entry['save_of_limit']:.2f} of ratio x raw write, load "
                  f"{entry['load_of_limit']:.2f} of ratio x raw read")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if benchlib.cuda_available() else "cpu")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--size", default=None, help="a state of about this size (e.g. 1GiB): picks width and depth")
    parser.add_argument("--steps", type=int, default=50, help="AdamW steps before saving")
    parser.add_argument("--repeat", type=int, default=1, help="rounds (round-robin over the methods; medians)")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=CODEC[,FIELD=VALUE...]",
                        help="a gdsckpt variant (repeatable; replaces the default ones)")
    parser.add_argument("--baselines", default="safetensors,dcp,dcp_zstd,naive_nvcomp_torch",
                        help="comma-separated baselines besides raw and torch ('none': no others)")
    parser.add_argument("--skip-baselines", action="store_true", help="the same as --baselines none")
    parser.add_argument("--drop-caches", action="store_true",
                        help="also drop the whole page cache before each read (needs root)")
    parser.add_argument("--dir", default="/tmp/gdsckpt-bench")
    parser.add_argument("--out", default="save-load-bench.json")
    args = parser.parse_args(argv)
    return benchlib.run_benchmark("save_load_bench", args, lambda report, directory: run(args, report, directory),
                                  print_table)


if __name__ == "__main__":
    sys.exit(main())
