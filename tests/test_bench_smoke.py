"""Smoke test of benchmarks/cpu_bench.py: one tiny run in a subprocess writes valid JSON in which
every load was bit-exact. No timing is asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "benchmarks" / "cpu_bench.py"


def test_cpu_bench_tiny_run_writes_bit_exact_json(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSCKPT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, str(SCRIPT), "--size", "8MiB", "--normal-size", "1MiB", "--repeat", "1",
               "--dir", str(tmp_path / "files"), "--out", str(out), "--cold", "fadvise",
               "--extra-variant", "auto-8k=auto,chunk_bytes=64KiB,pack_below=16KiB"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"wrote {out}" in done.stdout

    report = json.loads(out.read_text())
    assert report["benchmark"] == "cpu_bench" and report["cold_method"] == "fadvise"
    assert report["state"]["logical_bytes"] > 4 << 20
    assert set(report["state"]["bytes_by_dtype"]) == {"bfloat16", "float32"}
    for key in ("cpu_count", "python", "torch", "zstandard", "date", "filesystem"):
        assert report["host"][key], key
    methods = [row["method"] for row in report["results"]]
    for expected in ("torch", "safetensors", "gdsckpt/none", "gdsckpt/lz4", "gdsckpt/zstd", "gdsckpt/auto",
                     "gdsckpt/auto-8k"):
        assert expected in methods
    assert [row["dtype"] for row in report["normal"]] == ["bfloat16", "float32"]
    rows = report["results"] + report["normal"]
    for row in rows:
        assert row["bit_exact"] is True and row["problems"] == [], (row["method"], row["problems"])
        assert len(row["samples"]) == 1 and row["samples"][0]["bit_exact"] is True
        for key in ("ratio", "save_mb_s", "load_mb_s"):
            assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, (row["method"], key)
    assert report["all_bit_exact"] is True
    by_method = {row["method"]: row for row in report["results"]}
    assert by_method["gdsckpt/auto"]["ratio"] > by_method["gdsckpt/none"]["ratio"]
    assert by_method["gdsckpt/auto-8k"]["chunks"] > by_method["gdsckpt/auto"]["chunks"]
    # nothing is left behind in the benchmark's directory
    assert list((tmp_path / "files").iterdir()) == []
