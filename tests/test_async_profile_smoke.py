"""Smoke test of benchmarks/async_profile.py: its condition machinery on a tiny CPU model, in a
subprocess. Checks the JSON's structure, that the null sink replaced the save's writer (and only
in its condition), that the switch interval is applied, that background threads are found by name
in the per-thread CPU figures, and that the run cleans up. No timing is asserted (tiny CPU
figures are noise)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "benchmarks" / "async_profile.py"
CONDITIONS = ("a_idle", "b_gil_spin", "c_save_async", "d_null_sink", "g_switch_0.5ms", "e_d2h", "a_idle_end")


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_async_profile_cpu_smoke_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    files = tmp_path / "files"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSCKPT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, str(SCRIPT), "--cpu-smoke", "--steps", "4", "--min-steps", "2", "--settle", "1",
               "--max-condition-s", "0.5", "--conditions", ",".join(CONDITIONS), "--dir", str(files),
               "--out", str(out), "--timeout", "60"]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"wrote {out}" in done.stdout

    report = json.loads(out.read_text())
    assert report["errors"] == {}, report["errors"]
    assert report["benchmark"] == "async_profile" and report["device"] == "cpu"
    for key in ("host", "date", "versions", "filesystem", "config", "warm", "save_cpu"):
        assert report[key], key
    assert report["skipped"] == {"e_d2h": "needs CUDA"}
    assert positive(report["idle_reference"]["median_ms"])

    conditions = report["conditions"]
    assert list(conditions) == [c for c in CONDITIONS if c != "e_d2h"]
    for name, row in conditions.items():
        assert "error" not in row and "stop_error" not in row, (name, row)
        assert row["steps"] >= 2, name
        assert positive(row["wall_ms"]["median"]) and len(row["wall_ms_each"]) == row["steps"], name
        for phase in ("fwd_ms", "bwd_ms", "opt_ms", "sync_ms", "py_offcpu_ms"):
            assert phase in row, (name, phase)
        assert isinstance(row["slowdown_median"], float), name
        cpu = row["cpu"]
        assert positive(cpu["window_s"]) and positive(cpu["process_cpu_s"]), name
        assert "MainThread" in cpu["by_thread_s"], name

    # background threads are named in the CPU attribution
    assert "profile-gil-spin" in conditions["b_gil_spin"]["cpu"]["by_thread_s"]
    assert conditions["b_gil_spin"]["activity"]["window"]["iterations"] > 0

    saves = {name: conditions[name]["activity"] for name in ("c_save_async", "d_null_sink", "g_switch_0.5ms")}
    for name, activity in saves.items():
        assert activity["saves_completed"] >= 1 and activity["saves_completed"] == activity["saves_started"], name
        assert activity["engine"] == "cpu", name
    # the null sink took the writer's place in d only (patch undone afterwards: g writes files again)
    assert saves["d_null_sink"]["backend"] == "null-paced(profile)"
    assert positive(saves["d_null_sink"]["pace_bytes_per_s"])
    assert not saves["c_save_async"]["backend"].startswith("null")
    assert not saves["g_switch_0.5ms"]["backend"].startswith("null")
    assert saves["g_switch_0.5ms"]["switchinterval"] == 0.0005
    assert report["switchinterval_default"] == 0.005

    assert positive(report["save_cpu"]["seconds"]) and positive(report["warm"]["file_rate"])
    assert not files.exists()  # the run created its directory and removed it
