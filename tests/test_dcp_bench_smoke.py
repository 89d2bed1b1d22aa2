"""Smoke test of benchmarks/dcp_bench.py: one tiny CPU run in a subprocess (single process, then
2 gloo ranks) writes JSON in which every method saved, loaded and was bit-exact. No timing is
asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "benchmarks" / "dcp_bench.py"
METHODS = {"gdsckpt_dcp[auto]", "dcp_fs", "dcp_fs_zstd"}


def _positive(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_dcp_bench_tiny_cpu_run_writes_bit_exact_json(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSCKPT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--width", "64", "--depth", "1", "--steps", "1",
               "--ranks", "2", "--timeout", "240", "--dir", str(tmp_path / "files"), "--out", str(out)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=400, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"wrote {out}" in done.stdout

    report = json.loads(out.read_text())
    assert report["benchmark"] == "dcp_bench" and report["device"] == "cpu"
    assert report["errors"] == {}, report["errors"]
    for key in ("hostname", "python", "torch", "cpu_count"):
        assert report["host"][key], key
    assert report["versions"]["torch"] and report["versions"]["gdsckpt"] and report["date"]
    assert report["logical_bytes"] > 1 << 20
    runs = [report["single"], report["ranks"]["2"]["methods"]]
    assert report["ranks"]["2"]["world"] == 2 and report["ranks"]["2"]["backend"] == "gloo"
    assert report["ranks"]["2"]["logical_bytes"] == report["logical_bytes"]
    for rows in runs:
        assert set(rows) == METHODS
        for name, row in rows.items():
            assert row["bit_exact"] is True, name
            for key in ("save_gbps", "load_gbps", "ratio"):
                assert _positive(row[key]), (name, key, row.get(key))
            assert row["disk_bytes"] > 0 and row["files"] >= 2, name
    # gdsckpt wrote one compressed file per rank, through the CPU engine here
    assert [e["file"] for e in report["single"]["gdsckpt_dcp[auto]"]["engines"]] == ["__0_0.gdsckpt"]
    ranked = report["ranks"]["2"]["methods"]["gdsckpt_dcp[auto]"]["engines"]
    assert sorted(e["file"] for e in ranked) == ["__0_0.gdsckpt", "__1_0.gdsckpt"]
    assert {e["engine"] for e in ranked} == {"cpu"}
    assert report["single"]["gdsckpt_dcp[auto]"]["ratio"] > report["single"]["dcp_fs"]["ratio"]
    # the table comes last, and nothing is left behind in the benchmark's directory
    assert done.stdout.rstrip().splitlines()[-1].startswith("ranks=2")
    assert list((tmp_path / "files").iterdir()) == []
