"""Smoke test of benchmarks/async_bench.py: one tiny CPU run in a subprocess writes JSON with every
method's figures and the targets. No timing is asserted (tiny CPU figures are noise)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "benchmarks" / "async_bench.py"


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_async_bench_tiny_cpu_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSCKPT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, str(SCRIPT), "--width", "64", "--depth", "1", "--steps-before", "2",
               "--train-steps", "20", "--every", "5", "--rounds", "1", "--device", "cpu",
               "--dir", str(tmp_path / "files"), "--out", str(out), "--timeout", "120"]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"wrote {out}" in done.stdout
    assert "torch.distributed is disabled" not in done.stderr  # DCP's single-process warning is handled

    report = json.loads(out.read_text())
    assert report["errors"] == {}
    assert report["benchmark"] == "async_bench" and report["device"] == "cpu" and report["gpu"] is None
    for key in ("host", "date", "torch", "gdsckpt", "python"):
        assert report[key], key
    assert positive(report["logical_bytes"]) and positive(report["train_checkpoint_bytes"])

    blocked = report["blocked"]
    assert {"gdsckpt_save_async", "dcp_async_save", "torch_save"} <= set(blocked)
    # the device-snapshot variant runs once Config has snapshot_gpu_bytes, else it says why not
    assert ("gdsckpt_save_async_gpu_snapshot" in blocked) != ("gdsckpt_save_async_gpu_snapshot" in report["skipped"])
    assert "dcp_async_save_pinned" in report["skipped"]  # pinned staging needs CUDA
    for name, row in blocked.items():
        assert len(row["blocked_s"]) == 1 and len(row["completion_s"]) == 1, name
        assert positive(row["median_s"]) and positive(row["completion_median_s"]), name
        assert row["completion_median_s"] >= row["median_s"], name
        if name.startswith("gdsckpt"):
            assert positive(row["snapshot_seconds"][0]) and positive(row["ratio"][0]), name

    training = report["training"]
    assert training["every"] == 5 and training["steps"] == 20
    for name in ("none", "none_again", "gdsckpt_manager", "dcp_async_save"):
        assert positive(training[name]["steps_per_s"]), name
    assert positive(training["baseline_steps_per_s"])
    for name in ("gdsckpt_manager", "dcp_async_save"):
        run = training[name]
        assert run["checkpoints"] == 4 and len(run["blocked_s"]) == 4, name
        assert all(positive(s) for s in run["blocked_s"]), name
        assert positive(run["ratio_to_baseline"]), name
    assert training["none"]["checkpoints"] == 0
    assert training["gdsckpt_manager"]["steps_saved"] == [15, 20]  # keep_last=2
    assert len(training["gdsckpt_manager"]["snapshot_seconds"]) == 4

    targets = report["targets"]
    for key in ("blocked_le_one_third_of_dcp_async_save", "blocked_le_2pct_of_torch_save",
                "throughput_within_3pct_of_no_checkpoint"):
        target = targets[key]
        assert positive(target["reference"]) and positive(target["limit"]), key
        assert isinstance(target["met"], bool), key
        variants = target["variants"]
        assert variants and all(positive(v["ratio"]) and isinstance(v["met"], bool) for v in variants.values())
    assert targets["conditions"] == {"device_cuda": False, "state_ge_8GiB": False, "every_is_100": False}
    # nothing is left behind: the benchmark created its directory and removed it
    assert not (tmp_path / "files").exists()
