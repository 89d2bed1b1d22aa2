"""Where a GPU save's memory beyond the state goes (issue 3: 1108 MiB measured against a 1 GiB
staging budget at 8.76 GiB, 468 MiB against 512 MiB at 2 GiB).

One process, one GPU. For each scenario, a save of a state several times larger than
``max_staging_bytes`` runs while a thread samples, every millisecond: device memory in use
(``cudaMemGetInfo``, so nvCOMP's own allocations count), CuPy's default pool (our staging ring and
temporaries) and torch's reserved memory. It prints the peak of each and of the rest ("other":
nvCOMP scratch and module loads), the ring the engine allocated, and how many nvCOMP codec objects
the engine created. Scenarios vary what the hypotheses name: the mix of dtypes (one ANS codec
object per data type, each with its own scratch), the batch size (nvCOMP scratch measured for
batches up to 16 chunks only), and a warm-up that did or did not touch every dtype.

    python3 experiments/gpu_memory_probe.py --dir /root/probe --out probe.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path


import cupy
import torch

import gdsckpt
from gdsckpt.pipeline import gpu_engine

MiB = 1 << 20


class Sampler:
    """Peaks of device-wide use, CuPy's pool and torch's reserved memory over their entry values."""

    def __enter__(self) -> Sampler:
        torch.cuda.synchronize()
        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
        self.free0 = cupy.cuda.runtime.memGetInfo()[0]
        self.pool0 = cupy.get_default_memory_pool().total_bytes()
        self.torch0 = torch.cuda.memory_reserved()
        self.device = self.pool = self.torch = self.other = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def sample(self) -> None:
        device = self.free0 - cupy.cuda.runtime.memGetInfo()[0]
        pool = cupy.get_default_memory_pool().total_bytes() - self.pool0
        reserved = torch.cuda.memory_reserved() - self.torch0
        self.device, self.pool, self.torch = max(self.device, device), max(self.pool, pool), max(self.torch,
                                                                                                   reserved)
        self.other = max(self.other, device - pool - reserved)

    def _run(self) -> None:
        cupy.cuda.Device(0).use()
        while not self._stop.wait(0.001):
            self.sample()

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()


engines: list = []
_original_init = gpu_engine.GpuEngine.__init__


def _recording_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    engines.append(self)


gpu_engine.GpuEngine.__init__ = _recording_init


def state_of(kinds: str, total: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    state, pieces = {}, 6
    for i in range(pieces):
        kind = kinds[i % len(kinds)]
        n = total // pieces
        if kind == "b":
            state[f"w{i}"] = (torch.randn(n // 2, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        else:
            state[f"w{i}"] = torch.randn(n // 4, device="cuda", generator=g) * 0.02
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/root/gdsckpt-probe"))
    parser.add_argument("--out", type=Path, default=Path("gpu-memory-probe.json"))
    parser.add_argument("--state-gib", type=float, default=3.0)
    parser.add_argument("--budget-mib", type=int, default=1024)
    parser.add_argument("--scenarios", default="", help="comma-separated parts of scenario names to run")
    parser.add_argument("--codec-scan", default="zstd,deflate,gdeflate",
                        help="codecs to save at 4 and 1 MiB GPU chunks ('' to skip)")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    total = int(args.state_gib * (1 << 30))
    config = gdsckpt.Config(max_staging_bytes=args.budget_mib * MiB)
    results = {"host": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "torch": torch.__version__, "cupy": cupy.__version__, "state_bytes": total,
               "budget_bytes": args.budget_mib * MiB, "scenarios": {}}
    path = args.dir / "probe.gdsckpt"
    scenarios = [
        ("mixed, warm-up bf16 only", "bf", "b", 64, "ans"),
        ("mixed, warm-up both", "bf", "bf", 64, "ans"),
        ("bf16 only", "b", "bf", 64, "ans"),
        ("fp32 only", "f", "bf", 64, "ans"),
        ("mixed, batch 16", "bf", "bf", 16, "ans"),
        ("mixed, batch 8", "bf", "bf", 8, "ans"),
        # codec="auto" samples the candidates' ratios first (gpu_bench saves with it)
        ("mixed, codec auto", "bf", "bf", 64, "auto"),
    ]
    if args.scenarios:
        scenarios = [s for s in scenarios if any(part in s[0] for part in args.scenarios.split(","))]
    original_batch = gpu_engine.GpuEngine.__init__.__defaults__
    for name, kinds, warm_kinds, batch, codec in scenarios:
        try:
            warm = state_of(warm_kinds, 64 * MiB)
            gdsckpt.save(warm, args.dir / "warm.gdsckpt", codec="ans")
            del warm
            state = state_of(kinds, total)

            def init_with_batch(self, *a, _batch=batch, **k):
                k["batch_chunks"] = _batch
                _recording_init(self, *a, **k)

            gpu_engine.GpuEngine.__init__ = init_with_batch
            engines.clear()
            with Sampler() as peak:
                report = gdsckpt.save(state, path, codec=codec, config=config)
            gpu_engine.GpuEngine.__init__ = _recording_init
            engine = engines[-1] if engines else None
            row = {"device_peak_mib": peak.device / MiB, "cupy_pool_peak_mib": peak.pool / MiB,
                   "torch_reserved_peak_mib": peak.torch / MiB, "other_peak_mib": peak.other / MiB,
                   "ring_mib": engine.staging_bytes / MiB if engine else None,
                   "slots": engine.max_pending if engine else None,
                   "codec_objects": sorted(str(k) for k in engine._codecs) if engine else None,
                   "batch_chunks": batch, "ratio": report.ratio, "codec": report.codec, "auto": report.auto}
            results["scenarios"][name] = row
            del state
        except Exception as err:  # record and go on
            results["scenarios"][name] = {"error": f"{type(err).__name__}: {err}"}
        print(name, results["scenarios"][name], flush=True)
    del original_batch
    # nvCOMP Zstd / Deflate / GDeflate hold scratch that grows with the chunk size (ENCODE_SCRATCH):
    # smaller GPU chunks may let them fit the budget with more chunks per batch, at some speed.
    small = state_of("bf", 1 << 30)
    for codec in args.codec_scan.split(",") if args.codec_scan else []:
        for chunk_mib in (4, 1):
            name = f"{codec} {chunk_mib} MiB chunks, 1 GiB state"
            try:
                engines.clear()
                cfg = gdsckpt.Config(max_staging_bytes=args.budget_mib * MiB, gpu_chunk_bytes=chunk_mib * MiB)
                with Sampler() as peak:
                    started = time.perf_counter()
                    report = gdsckpt.save(small, path, codec=codec, config=cfg)
                    seconds = time.perf_counter() - started
                loaded = gdsckpt.load(path, device="cuda")
                exact = all(torch.equal(small[k].view(torch.uint8), loaded[k].view(torch.uint8)) for k in small)
                engine = engines[-1] if engines else None
                results["scenarios"][name] = {
                    "device_peak_mib": peak.device / MiB, "cupy_pool_peak_mib": peak.pool / MiB,
                    "torch_reserved_peak_mib": peak.torch / MiB, "other_peak_mib": peak.other / MiB,
                    "ring_mib": engine.staging_bytes / MiB if engine else None,
                    "slots": engine.max_pending if engine else None, "codec_objects": None,
                    "seconds": seconds, "gbps": report.logical_bytes / seconds / 1e9, "ratio": report.ratio,
                    "bit_exact": exact}
            except Exception as err:  # record and go on
                results["scenarios"][name] = {"error": f"{type(err).__name__}: {err}"}
            print(name, results["scenarios"][name], flush=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"{'scenario':28} {'device':>8} {'pool':>8} {'torch':>8} {'other':>8} {'ring':>8} slots codecs")
    for name, row in results["scenarios"].items():
        if "error" in row:
            print(f"{name:28} {row['error']}")
            continue
        print(f"{name:28} {row['device_peak_mib']:8.0f} {row['cupy_pool_peak_mib']:8.0f} "
              f"{row['torch_reserved_peak_mib']:8.0f} {row['other_peak_mib']:8.0f} {row['ring_mib']:8.0f} "
              f"{row['slots']:5} {len(row['codec_objects'] or [])} "
              f"{row.get('gbps', 0):.2f} GB/s")


if __name__ == "__main__":
    main()
