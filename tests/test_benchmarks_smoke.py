"""Smoke test of the benchmark suite (benchmarks/README.md): each benchmark runs at a tiny size on
the CPU in a subprocess and writes JSON of the shared schema (benchmarks/benchlib.py) in which
every bit-exact check passed and nothing failed; the GPU benchmark skips cleanly without CUDA.
No timing is asserted: tiny CPU figures are noise."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
REQUIRED = ("schema", "benchmark", "command", "args", "host", "device", "state", "results", "limits", "checks",
            "bit_exact", "errors", "skipped", "seconds")
TINY = ["--width", "64", "--depth", "1"]


def run(tmp_path: Path, script: str, *args: str, timeout: float = 120) -> dict:
    out = tmp_path / f"{script}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSCKPT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, str(BENCHMARKS / script), *args, "--dir", str(tmp_path / "files"), "--out", str(out)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"wrote {out}" in done.stdout
    assert not (tmp_path / "files").exists()  # the run removed its files
    report = json.loads(out.read_text())
    assert [key for key in REQUIRED if key not in report] == []
    assert report["schema"] == "gdsckpt-bench/1" and report["benchmark"] == script.removesuffix(".py")
    for key in ("date", "hostname", "cpu_count", "python", "versions", "filesystem"):
        assert report["host"][key], key
    assert report["host"]["versions"]["torch"] and report["host"]["versions"]["gdsckpt"]
    return report


def measured(report: dict) -> None:
    """A run that measured: nothing failed, every check bit-exact, the state described."""
    assert report["device"] == "cpu" and report["skipped"].get("all") is None
    assert report["errors"] == {}, report["errors"]
    assert report["checks"] and all(report["checks"].values()), report["checks"]
    assert report["bit_exact"] is True
    assert report["state"]["logical_bytes"] > 1 << 20


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_save_load_bench_cpu(tmp_path: Path) -> None:
    report = run(tmp_path, "save_load_bench.py", "--device", "cpu", *TINY, "--steps", "1",
                 "--variant", "none=none", "--variant", "zstd=zstd", "--baselines", "safetensors,dcp")
    measured(report)
    results = report["results"]
    assert {"raw", "gdsckpt/none", "gdsckpt/zstd", "torch", "safetensors", "dcp"} <= set(results)
    for name, row in results.items():
        assert positive(row["ratio"]) and positive(row["save_gbps"]) and positive(row["load_gbps"]), name
    # a named codec, not auto: auto may store chunks as they are on a busy machine (adaptive)
    assert results["gdsckpt/zstd"]["ratio"] > results["gdsckpt/none"]["ratio"]
    assert set(results["gdsckpt/none"]["group_ratios"]) >= {"model", "master", "optimizer/exp_avg"}  # the first variant
    assert positive(report["limits"]["gdsckpt/zstd"]["save_limit_gbps"])


def test_save_load_bench_cuda_skips_cleanly_without_cuda(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the GPU run is the GPU host's (benchmarks/gpu_run.sh)")
    report = run(tmp_path, "save_load_bench.py", "--device", "cuda", *TINY)
    assert "needs CUDA" in report["skipped"]["all"]
    assert report["results"] == {} and report["checks"] == {} and report["bit_exact"] is None


def test_portable_bench_skips_cleanly_without_cuda(tmp_path: Path) -> None:
    """The portable benchmark measures CUDA state only (issue 19's GPU-host figures)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the GPU run is the GPU host's")
    report = run(tmp_path, "portable_bench.py", "--size", "4MiB")
    assert "needs CUDA" in report["skipped"]["all"]
    assert report["results"] == {} and report["checks"] == {} and report["bit_exact"] is None


def test_async_bench_cpu(tmp_path: Path) -> None:
    report = run(tmp_path, "async_bench.py", "--device", "cpu", *TINY, "--steps-before", "1", "--rounds", "1",
                 "--train-steps", "4", "--every", "2", "--workers", "thread", "--timeout", "60")
    measured(report)
    blocked, training = report["results"]["blocked"], report["results"]["training"]
    assert {"gdsckpt_save_async", "gdsckpt_save_async_gpu_snapshot", "dcp_async_save", "torch_save"} <= set(blocked)
    assert set(report["checks"]) == {"gdsckpt_save_async", "gdsckpt_save_async_gpu_snapshot"}
    for name, row in blocked.items():
        assert positive(row["median_s"]) and row["completion_median_s"] >= row["median_s"], name
    assert positive(training["gdsckpt_manager"]["ratio_to_baseline"])
    assert "throughput_within_3pct_of_no_checkpoint" in report["limits"]


def test_dcp_bench_cpu(tmp_path: Path) -> None:
    report = run(tmp_path, "dcp_bench.py", "--device", "cpu", *TINY, "--steps", "1", "--ranks", "2",
                 "--timeout", "90")
    measured(report)
    assert set(report["results"]["single"]) == {"gdsckpt_dcp[auto]", "dcp_fs", "dcp_fs_zstd"}
    assert report["results"]["ranks"]["2"]["world"] == 2
    assert len(report["checks"]) == 6
    assert positive(report["limits"]["single/gdsckpt_dcp[auto]"]["save_x_dcp_fs"])


def test_delta_bench_cpu(tmp_path: Path) -> None:
    report = run(tmp_path, "delta_bench.py", "--device", "cpu", *TINY, "--warmup", "1", "--intervals", "1",
                 "--count", "3", "--codec", "zstd", "--lossy-bounds", "1e-2", "--resume", "10")
    measured(report)
    deltas = report["results"]["deltas"]["1"]
    assert deltas["bit_exact"] is True and deltas["delta_bytes"] < deltas["full_bytes"]
    bounds = report["results"]["lossy"]["bounds"]
    assert len(bounds) == 3 and all(row["optimizer_ratio"] > 1 for row in bounds.values())
    assert "lossy_optimizer_ge_4x_loss_within_0.5pct" in report["limits"]


def test_gpu_probe_skips_cleanly_without_cuda() -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_probe.py")], check=False, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "needs CUDA" in json.loads(done.stdout)["skipped"]


def test_tier_bench_cpu(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    report = run(tmp_path, "tier_bench.py", "--device", "cpu", "--size", "4MiB", "--steps", "1", "--repeat", "1",
                 "--restores", "2", "--small", "50", "--profile", "--shm-dir", str(shm))
    measured(report)
    assert report["results"]["page_cache/gdsckpt"]["runs"] == 2  # --restores passes in the one round
    for name in ("page_cache/raw", "page_cache/gdsckpt", "tmpfs/raw", "tmpfs/gdsckpt", "null_source/gdsckpt",
                 "null_sink/gdsckpt", "save_tmpfs/gdsckpt", "small_50/gdsckpt_save", "small_50/torch_load"):
        assert positive(report["results"][name]["gbps"]), name
    for name in ("page_cache/gdsckpt", "tmpfs/gdsckpt"):
        assert positive(report["limits"][name]["fraction"]) and report["limits"][name]["target_fraction"] == 0.9
    assert set(report["profile"]) == {"page_cache", "tmpfs", "null_source", "null_sink"}
    assert list(shm.iterdir()) == []  # the tmpfs stand-in is left empty
