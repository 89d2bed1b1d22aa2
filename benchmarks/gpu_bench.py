"""GPU benchmark: gdsckpt against raw kvikio, torch.save/torch.load on one training state, one run.

The state: a GPT-style model (gdsckpt.demo.TinyGPT) trained ``--steps`` AdamW steps on random
tokens on the GPU; saved as bf16 weights + fp32 master weights + exp_avg + exp_avg_sq (the
mixed-precision layout). Writes are durable (fsync inside the timing); reads are cold (the file
is dropped from the page cache with posix_fadvise(DONTNEED) after an fsync). Prints a table and
writes JSON (host, date, versions, every figure).

    python3 benchmarks/gpu_bench.py --width 2048 --depth 8 --dir /root/bench --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import gdsckpt  # noqa: E402
from gdsckpt.demo import TinyGPT, bit_equal, train_steps  # noqa: E402


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def build_state(width: int, depth: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(vocab=8192, width=width, depth=depth, heads=16, context=128).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_steps(model, optimizer, steps, seed=0, batch=4, length=128)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {"model": {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()},
             "master": {n: p.detach().clone() for n, p in model.named_parameters()},
             "optimizer": {names[id(p)]: {k: v for k, v in s.items() if k != "step"}
                           for p, s in optimizer.state.items()}}
    torch.cuda.synchronize()
    return state


def tensors(state: dict) -> list[torch.Tensor]:
    out = []
    for value in state.values():
        out.extend(tensors(value) if isinstance(value, dict) else [value])
    return out


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


class MemorySampler:
    """Peak GPU memory in use (device-wide, over the value at entry) and host RSS growth, sampled
    every 2 ms on a thread while the block runs."""

    def __enter__(self) -> "MemorySampler":
        import threading

        import cupy
        import psutil

        torch.cuda.empty_cache()  # cached blocks of earlier steps would hide this step's use
        cupy.get_default_memory_pool().free_all_blocks()

        self._process = psutil.Process()
        free, _total = torch.cuda.mem_get_info()
        self._free0, self._rss0 = free, self._process.memory_info().rss
        self._reserved0 = torch.cuda.memory_reserved()
        self.gpu_peak = self.rss_peak = self.cupy_peak = self.torch_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        import cupy

        free, _total = torch.cuda.mem_get_info()
        self.gpu_peak = max(self.gpu_peak, self._free0 - free)
        # where it went: CuPy's pool (the staging ring, batch buffers) and torch's caching
        # allocator; the rest of the device-wide figure is native (nvCOMP scratch, CUDA modules)
        self.cupy_peak = max(self.cupy_peak, cupy.get_default_memory_pool().total_bytes())
        self.torch_peak = max(self.torch_peak, torch.cuda.memory_reserved() - self._reserved0)
        self.rss_peak = max(self.rss_peak, self._process.memory_info().rss - self._rss0)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self._sample()

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()
        # what torch's caching allocator took meanwhile: tensors restored into it, which are the
        # state itself, not the pipeline's overhead
        self.torch_growth = torch.cuda.memory_reserved() - self._reserved0


def flat_dict(state: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flat_dict(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def fsync_tree(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def safetensors_save(state: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in flat_dict(state).items()}, str(path))
    fsync_tree(path)


def safetensors_load(path: Path) -> None:
    from safetensors.torch import load_file

    load_file(str(path), device="cuda")


def dcp_save(state: dict, path: Path, *, zstd: bool) -> None:
    import torch.distributed.checkpoint as dcp

    kwargs = {}
    if zstd:
        from torch.distributed.checkpoint._extension import ZStandard

        kwargs["_extensions"] = [ZStandard()]
    dcp.save(flat_dict(state), storage_writer=dcp.FileSystemWriter(str(path), sync_files=True, **kwargs))


def dcp_load(state: dict, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    if not path.exists():
        raise FileNotFoundError(path)
    template = {k: torch.empty_like(v) for k, v in flat_dict(state).items()}
    dcp.load(template, storage_reader=dcp.FileSystemReader(str(path)))


def naive_save(state: dict, path: Path) -> None:
    """The do-it-yourself approach: nvCOMP ANS encode per tensor, then torch.save of the buffers."""
    import cupy
    from nvidia import nvcomp

    codec = nvcomp.Codec(algorithm="ANS")
    encoded = {}
    for key, tensor in flat_dict(state).items():
        array = codec.encode(nvcomp.as_array(cupy.asarray(tensor.reshape(-1).view(torch.uint8))))
        data = torch.from_dlpack(array).view(torch.uint8).reshape(-1)[: array.buffer_size].clone()
        encoded[key] = (data, str(tensor.dtype), tuple(tensor.shape))
    with path.open("wb") as handle:
        torch.save(encoded, handle)
        handle.flush()
        os.fsync(handle.fileno())


def naive_load(path: Path) -> None:
    import cupy
    from nvidia import nvcomp

    codec = nvcomp.Codec(algorithm="ANS")
    encoded = torch.load(path, map_location="cuda", weights_only=True)
    for data, _dtype, _shape in encoded.values():
        decoded = codec.decode(nvcomp.as_array(cupy.asarray(data)))
        torch.from_dlpack(decoded)
    torch.cuda.synchronize()


def group_ratios(path: Path) -> dict:
    info = gdsckpt.inspect(path)
    groups: dict = {}
    for tensor in info.tensors:
        parts = tensor.key.split("/")
        group = parts[0] if parts[0] != "optimizer" else f"optimizer/{parts[-1]}"
        raw, stored = groups.get(group, (0, 0))
        groups[group] = (raw + tensor.nbytes, stored + tensor.stored_bytes)
    return {g: raw / stored for g, (raw, stored) in groups.items() if stored}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dir", default="/tmp/gdsckpt-bench")
    parser.add_argument("--out", default="gpu-bench.json")
    parser.add_argument("--skip-baselines", action="store_true",
                        help="skip safetensors, DCP and the naive approach (torch.save stays)")
    parser.add_argument("--baselines", default="safetensors,dcp,dcp_zstd,naive_nvcomp_torch",
                        help="comma-separated baselines to run (torch.save always runs)")
    args = parser.parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    state = build_state(args.width, args.depth, args.steps)
    flat = tensors(state)
    logical = sum(t.numel() * t.element_size() for t in flat)
    results: dict = {"host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                     "gdsckpt": gdsckpt.__version__, "logical_bytes": logical, "width": args.width,
                     "depth": args.depth, "steps": args.steps, "runs": {}}
    import kvikio

    results["kvikio"] = kvikio.__version__
    raw_path = directory / "raw.bin"

    def raw_write() -> None:
        with kvikio.CuFile(raw_path, "w") as f:
            offset, futures = 0, []
            for t in flat:
                view = t.reshape(-1).view(torch.uint8)
                futures.append(f.pwrite(view, view.numel(), offset))
                offset += view.numel()
            for future in futures:
                future.get()
        fd = os.open(raw_path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def raw_read() -> None:
        with kvikio.CuFile(raw_path, "r") as f:
            offset, futures = 0, []
            for t in flat:
                buf = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, device="cuda")
                futures.append(f.pread(buf, buf.numel(), offset))
                offset += buf.numel()
            for future in futures:
                future.get()

    ours = directory / "state.gdsckpt"
    theirs = directory / "state.pt"
    reports = {}

    def ours_save() -> None:
        reports["save"] = gdsckpt.save(state, ours)

    def theirs_save() -> None:
        with theirs.open("wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())

    loaded = {}
    runs = results["runs"]
    errors = results.setdefault("errors", {})

    def attempt(name: str, fn) -> None:
        try:
            runs[name] = logical / timed(fn) / 1e9
        except Exception as err:  # a baseline this torch lacks: record, keep going
            errors[name] = f"{type(err).__name__}: {err}"

    from gdsckpt.pipeline.autotune import storage_gbps

    results["storage_gbps_probe"] = storage_gbps(directory)  # cached before timing, as in steady use
    runs["kvikio_raw_write"] = logical / timed(raw_write) / 1e9
    # One small save and load first, as any process that has checkpointed once has done: nvCOMP's
    # and CuPy's kernels load on first use (a one-time, process-wide cost, like the CUDA context)
    # and would otherwise count as this save's memory beyond the state.
    warm = directory / "warm.gdsckpt"
    gdsckpt.save({"w": flat[0].reshape(-1)[: 1 << 22]}, warm)
    gdsckpt.load(warm, device="cuda")
    warm.unlink()
    with MemorySampler() as memory:
        runs["gdsckpt_save"] = logical / timed(ours_save) / 1e9
    results["save_gpu_bytes_beyond_state"] = memory.gpu_peak
    results["save_gpu_breakdown"] = {"cupy_pool_peak": memory.cupy_peak, "torch_reserved_peak": memory.torch_peak}
    results["save_host_rss_growth"] = memory.rss_peak
    runs["torch_save"] = logical / timed(theirs_save) / 1e9
    st_path, dcp_path, dcp_zstd_path, naive_path = (directory / n for n in ("st.safetensors", "dcp", "dcp-zstd",
                                                                           "naive.pt"))
    import shutil

    # Baselines one at a time (save, cold load, delete): the disk holds ~64 GiB, not seven copies.
    baselines = () if args.skip_baselines else (
            ("safetensors", lambda p: safetensors_save(state, p), safetensors_load, st_path),
            ("dcp", lambda p: dcp_save(state, p, zstd=False), lambda p: dcp_load(state, p), dcp_path),
            ("dcp_zstd", lambda p: dcp_save(state, p, zstd=True), lambda p: dcp_load(state, p), dcp_zstd_path),
            ("naive_nvcomp_torch", lambda p: naive_save(state, p), naive_load, naive_path))
    chosen = set(args.baselines.split(","))
    for name, save_fn, load_fn, path in baselines:
        if name not in chosen:
            continue
        attempt(f"{name}_save", lambda: save_fn(path))
        if path.exists():
            for file in ([path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]):
                drop_cache(file)
            attempt(f"{name}_load_cold", lambda: load_fn(path))
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in (raw_path, ours, theirs):
        drop_cache(path)
    runs["kvikio_raw_read_cold"] = logical / timed(raw_read) / 1e9
    with MemorySampler() as memory:
        runs["gdsckpt_load_cold"] = logical / timed(lambda: loaded.__setitem__(
            "ours", gdsckpt.load(ours, device="cuda"))) / 1e9
    results["load_gpu_bytes_beyond_state"] = memory.gpu_peak - memory.torch_growth
    results["load_torch_allocator_growth"] = memory.torch_growth
    results["load_host_rss_growth"] = memory.rss_peak
    runs["torch_load_cold"] = logical / timed(lambda: loaded.__setitem__(
        "theirs", torch.load(theirs, map_location="cuda", weights_only=True))) / 1e9
    loaded.pop("theirs", None)
    results["group_ratios"] = group_ratios(ours)
    report = reports["save"]
    results["ratio"] = report.ratio
    results["codec"], results["backend"], results["chains"] = report.codec, report.backend, report.chains
    results["auto"] = report.auto
    results["bit_exact"] = all(bit_equal(a, b) for a, b in zip(flat, tensors(loaded["ours"])))
    results["ratio_torch"] = logical / theirs.stat().st_size
    from gdsckpt.io import NullWriter
    from gdsckpt.pipeline.gpu_engine import GpuEngine
    from gdsckpt.pipeline.plan import plan_chunks
    from gdsckpt.pipeline.save import run_save
    from gdsckpt.state import flatten
    from gdsckpt.api import _build_index

    flat_state = flatten(state)
    config = gdsckpt.Config()
    for chunk_mib in (4, 16):
        chunk = chunk_mib << 20
        plans = plan_chunks([(a.source.nbytes, a.source.itemsize, a.source.plane_width)
                             for a in flat_state.arrays], chunk_bytes=chunk, pack_below=config.pack_below)
        for repeat in range(2):  # the first pass includes nvCOMP's and CuPy's warm-up
            engine = GpuEngine([a.source for a in flat_state.arrays], codec="ans", byte_planes="auto",
                               device_id=0, chunk_bytes=chunk, max_staging_bytes=config.max_staging_bytes)
            seconds = timed(lambda: run_save(plans, engine, NullWriter(),
                                             max_inflight_bytes=config.max_staging_bytes,
                                             build_index=lambda r: _build_index(flat_state, r)))
            engine.close()
            runs[f"gdsckpt_null_sink_{chunk_mib}MiB_pass{repeat + 1}"] = logical / seconds / 1e9
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"state: {logical / 2**30:.2f} GiB, ratio {results['ratio']:.3f} ({results['codec']}, "
          f"{results['backend']}), bit-exact {results['bit_exact']}")
    print("group ratios:", {k: round(v, 3) for k, v in results["group_ratios"].items()})
    print(f"save: GPU memory beyond the state {results['save_gpu_bytes_beyond_state'] / 2**20:.0f} MiB, "
          f"host RSS growth {results['save_host_rss_growth'] / 2**20:.0f} MiB; load: GPU beyond the "
          f"restored state {results['load_gpu_bytes_beyond_state'] / 2**20:.0f} MiB, host RSS growth "
          f"{results['load_host_rss_growth'] / 2**20:.0f} MiB")
    breakdown = results["save_gpu_breakdown"]
    print(f"save memory breakdown: CuPy pool peak {breakdown['cupy_pool_peak'] / 2**20:.0f} MiB, torch reserved "
          f"growth peak {breakdown['torch_reserved_peak'] / 2**20:.0f} MiB")
    for name, error in results["errors"].items():
        print(f"  {name}: {error[:200]}")
    for name, value in runs.items():
        print(f"  {name:24} {value:8.2f} GB/s")
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
