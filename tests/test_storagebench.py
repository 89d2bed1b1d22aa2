"""``gdsckpt bench`` and ``gdsckpt.tools.storagebench`` on the CPU: a tiny real run against two
directories (JSON, table, plots, presets, cleanup), the recommendation rule, refusals and exit
codes, and cleanup when the run is interrupted. No timing is asserted beyond "positive"."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import gdsckpt
from gdsckpt.cli import bench
from gdsckpt.config import parse_size
from gdsckpt.tools import storagebench as sb

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO_ROOT = Path(__file__).resolve().parent.parent
# The subcommand's parser as gdsckpt.cli.main builds it (global --quiet, then the subcommand);
# built here so the tests do not depend on main.py wiring the subcommand in.
HARNESS = """
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell running the tests in the background ignores SIGINT
import argparse, sys
from gdsckpt.cli import bench
parser = argparse.ArgumentParser(prog="gdsckpt")
parser.add_argument("--quiet", action="store_true")
bench.register(parser.add_subparsers(dest="command", required=True))
args = parser.parse_args(sys.argv[1:])
sys.exit(args.run(args))
"""


def run_bench(*argv: str) -> tuple[int, str]:
    """Parse ``argv`` as ``gdsckpt bench ...`` would and run it here; returns (exit code, stdout)."""
    parser = argparse.ArgumentParser(prog="gdsckpt")
    parser.add_argument("--quiet", action="store_true")
    bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["--quiet", "bench", *argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = args.run(args)
    return code, out.getvalue()


def bench_files(directory: Path) -> list[Path]:
    """Everything under ``directory`` (the benchmark must leave a target as it found it)."""
    return sorted(directory.rglob("*"))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One real run: 2 targets x (raw POSIX, 2 codecs x 2 chunk sizes, torch, safetensors)."""
    root = tmp_path_factory.mktemp("bench")
    targets = [root / "nvme", root / "shared"]
    for target in targets:
        target.mkdir()
    out = root / "out"
    code, stdout = run_bench(
        "--target", str(targets[0]), "--target", str(targets[1]), "--size", "1MiB", "--codecs", "lz4,none",
        "--chunk-sizes", "64KiB,256KiB", "--threads", "2", "--repeats", "2", "--device", "cpu",
        "--out", str(out), "--recommend", "--preset-out", str(out / "presets" / "{target}.toml"))
    return {"code": code, "stdout": stdout, "targets": targets, "out": out,
            "report": json.loads((out / "bench.json").read_text())}


def test_tiny_run_succeeds_and_prints_a_table_per_target(tiny_run: dict[str, Any]) -> None:
    assert tiny_run["code"] == 0, tiny_run["stdout"]
    stdout = tiny_run["stdout"]
    for target in tiny_run["targets"]:
        assert f"{target}: " in stdout
    assert "save GB/s" in stdout and "load GB/s" in stdout and "warm GB/s" in stdout
    # every gdsckpt row carries its figures over ratio x raw of the same target
    assert stdout.count(" x limit ") == 2 * 4 and "x limit: save/cold/warm" in stdout
    assert "may still serve it from its own cache" in stdout, "the cold-read caveat is printed"
    assert "not run: raw_kvikio, gdsckpt_gpu, null_gpu" in stdout
    assert stdout.count("recommended for ") == 2


def test_json_has_every_configuration_with_positive_figures(tiny_run: dict[str, Any]) -> None:
    report = tiny_run["report"]
    assert report["schema"] == sb.SCHEMA and report["gdsckpt"] == gdsckpt.__version__
    assert report["all_ok"] is True
    assert report["ran"] == {"raw_posix": True, "raw_kvikio": False, "gdsckpt_cpu": True,
                             "gdsckpt_gpu": False, "null_cpu": True, "null_gpu": False, "torch": True,
                             "safetensors": True}
    settings = report["settings"]
    assert settings["chunk_sizes"] == [64 << 10, 256 << 10] and settings["codecs"] == ["lz4", "none"]
    assert settings["device"] == "cpu" and settings["repeats"] == 2
    data = report["data"]
    assert data["logical_bytes"] == sb.logical_bytes_for(1 << 20) and data["tensors"] > 10
    assert set(data["bytes_by_dtype"]) == {"bfloat16", "float32"}
    assert "fadvise" in report["method"]["load"] and "fsync" in report["method"]["save"]
    assert [t["path"] for t in report["targets"]] == [str(t.resolve()) for t in tiny_run["targets"]]
    for target in report["targets"]:
        assert target["free_bytes_before"] > 0 and target["filesystem"]["type"] != ""
        rows = target["results"]
        kinds = sorted((r["path"], r["codec"], r["chunk_bytes"]) for r in rows
                       if r["path"] not in ("torch", "safetensors", "gdsckpt-null"))
        assert kinds == sorted([("raw-posix", None, 64 << 10), ("raw-posix", None, 256 << 10)]
                               + [("gdsckpt", c, s) for c in ("lz4", "none") for s in (64 << 10, 256 << 10)])
        assert {r["path"] for r in rows} == {"raw-posix", "gdsckpt", "gdsckpt-null", "torch", "safetensors"}
        null = next(r for r in rows if r["path"] == "gdsckpt-null")  # the pipeline without storage
        assert null["kind"] == "null" and null["codec"] == "lz4" and null["backend"] == "null"
        for row in rows:
            assert row["status"] == "ok" and row["bit_exact"] is True, row
            assert len(row["save_seconds"]) == 2 and len(row["load_seconds"]) == 2, row
            assert len(row["warm_load_seconds"]) == 2, row
            for key in ("save_gbps", "load_gbps", "warm_load_gbps", "ratio"):
                assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, (row, key)
            assert row["logical_bytes"] == data["logical_bytes"] and row["file_bytes"] > 0
        gds = {(r["codec"], r["chunk_bytes"]): r for r in rows if r["path"] == "gdsckpt"}
        assert all(r["engine"] == "cpu" and r["threads"] == 2 for r in gds.values())
        # the knobs really reached the save: lz4 compresses, none does not; smaller chunks, more chunks
        assert gds[("lz4", 64 << 10)]["ratio"] > 1.0 > gds[("none", 64 << 10)]["ratio"] * 0.999
        assert gds[("lz4", 64 << 10)]["details"]["chunks"] > gds[("lz4", 256 << 10)]["details"]["chunks"]
        assert target["recommendation"]["fields"]["codec"] in ("lz4", "none")


def test_no_bench_file_is_left_in_a_target(tiny_run: dict[str, Any]) -> None:
    for target in tiny_run["targets"]:
        assert bench_files(target) == []


def test_recommended_preset_is_a_loadable_config(tiny_run: dict[str, Any]) -> None:
    presets = sorted((tiny_run["out"] / "presets").glob("*.toml"))
    assert [p.name for p in presets] == ["1-nvme.toml", "2-shared.toml"]
    config_fields = {f.name for f in dataclasses.fields(gdsckpt.Config)}
    for preset, target in zip(presets, tiny_run["report"]["targets"]):
        text = preset.read_text()
        header = [line for line in text.splitlines() if line.startswith("#")]
        assert any(line.startswith("# date: ") for line in header)
        assert any(line.startswith("# host: ") for line in header)
        assert any(line.startswith(f"# target: {target['path']} ") for line in header)
        assert any(line.startswith("# measured: gdsckpt cpu ") and "GB/s" in line for line in header)
        values = tomllib.loads(text)
        assert set(values) <= config_fields
        assert {"codec", "chunk_bytes", "io_threads", "max_inflight_bytes", "storage_gbps"} <= set(values)
        coerced = {key: parse_size(value) if key.endswith("_bytes") else value
                   for key, value in values.items()}
        config = gdsckpt.Config(**coerced)
        assert config.codec == target["recommendation"]["fields"]["codec"]
        assert config.chunk_bytes == target["recommendation"]["fields"]["chunk_bytes"]
        assert config.io_threads == 2 and config.storage_gbps > 0
        from_toml = getattr(gdsckpt.Config, "from_toml", None)
        if from_toml is not None:  # the config-file loader, where this build has it
            assert from_toml(preset, base=gdsckpt.Config()) == config


def test_plots_are_written_per_target(tiny_run: dict[str, Any]) -> None:
    pytest.importorskip("matplotlib")
    for name in ("bench-1-nvme-cpu.png", "bench-2-shared-cpu.png"):
        data = (tiny_run["out"] / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_without_matplotlib_plots_are_skipped_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes ``import matplotlib...`` fail
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    report = sb.BenchReport(sb.BenchSettings(), {}, {"logical_bytes": 1}, [], "today")
    with caplog.at_level(logging.WARNING, logger="gdsckpt"):
        assert sb.write_plots(report, tmp_path) == []
    assert "matplotlib is not installed" in caplog.text
    assert list(tmp_path.iterdir()) == []


def _measurement(codec: str, save_s: float, file_bytes: int, load_s: float = 1.0,
                 **changes: Any) -> sb.Measurement:
    """A finished gdsckpt measurement of 1 GB: ``save_s`` / ``load_s`` seconds, ``file_bytes`` stored."""
    fields: dict[str, Any] = {
        "path": "gdsckpt", "kind": "gdsckpt", "device": "cpu", "engine": "cpu", "codec": codec,
        "chunk_bytes": 4 << 20, "threads": 8, "inflight_bytes": 256 << 20, "status": "ok",
        "logical_bytes": 10**9, "file_bytes": file_bytes, "save_seconds": [save_s], "load_seconds": [load_s],
        "bit_exact": True}
    fields.update(changes)
    return sb.Measurement(**fields)


def test_recommend_takes_the_fastest_save_and_breaks_ties_by_ratio_then_load() -> None:
    raw = sb.Measurement("raw-posix", "raw", "cpu", chunk_bytes=4 << 20, threads=8, status="ok",
                         logical_bytes=10**9, file_bytes=10**9, save_seconds=[0.5], load_seconds=[0.4],
                         bit_exact=True)
    fast_plain = _measurement("none", 1.00, 10**9)
    tied_smaller = _measurement("lz4", 1.02, 8 * 10**8, load_s=2.0)        # within 3%: fewer bytes wins
    tied_same_ratio = _measurement("zstd", 1.01, 8 * 10**8 + 10**6, load_s=1.5)  # ratio within 1%, faster
    slow_small = _measurement("zstd", 2.0, 5 * 10**8, chunk_bytes=16 << 20)  # best ratio, but not a tie
    broken = _measurement("lz4", 0.5, 5 * 10**8, bit_exact=False)           # fastest, but not bit-exact
    failed = _measurement("lz4", 0.4, 5 * 10**8, status="failed")
    result = sb.TargetResult("/t", {"type": "ext4", "device": "d", "mount_point": "/"}, 1,
                             [raw, fast_plain, tied_smaller, tied_same_ratio, slow_small, broken, failed])
    chosen = sb.recommend(result)
    assert chosen is not None and chosen.measurement is tied_same_ratio
    assert chosen.fields == {"codec": "zstd", "chunk_bytes": 4 << 20, "io_threads": 8,
                             "max_inflight_bytes": 256 << 20, "storage_gbps": 2.0}
    assert "loads fastest" in chosen.reason
    tied_same_ratio.load_seconds = [3.0]
    assert sb.recommend(result).measurement is tied_smaller
    assert sb.recommend(sb.TargetResult("/t", {}, 1, [raw, broken, failed])) is None


def test_limit_fractions_put_each_figure_over_ratio_times_raw() -> None:
    raw = sb.Measurement("raw-posix", "raw", "cpu", chunk_bytes=4 << 20, threads=8, status="ok",
                         logical_bytes=10**9, file_bytes=10**9, save_seconds=[1.0], load_seconds=[0.5],
                         warm_load_seconds=[0.1], bit_exact=True)  # 1, 2 and 10 GB/s
    mine = _measurement("zstd", 1.0, 8 * 10**8, load_s=0.5, warm_load_seconds=[0.2])  # ratio 1.25
    fractions = sb.limit_fractions(sb.TargetResult("/t", {}, 1, [raw, mine]), mine)
    assert fractions == pytest.approx({"save": 1 / 1.25, "load": 2 / 2.5, "warm_load": 5 / 12.5})
    assert sb.limit_fractions(sb.TargetResult("/t", {}, 1, [mine]), mine) is None  # no raw I/O ran
    # Raw I/O moves its file, padded to whole pages: a 100-byte state is a 4 KiB raw file, and the
    # storage's speed is the file's bytes per second (the logical bytes' made the fractions 40x)
    padded = sb.Measurement("raw-posix", "raw", "cpu", chunk_bytes=4 << 20, threads=8, status="ok",
                            logical_bytes=100, file_bytes=4096, save_seconds=[1e-3], load_seconds=[1e-3],
                            warm_load_seconds=[1e-3], bit_exact=True)
    small = sb.Measurement("gdsckpt", "gdsckpt", "cpu", chunk_bytes=4 << 20, threads=8, status="ok",
                           logical_bytes=100, file_bytes=8192, save_seconds=[1e-3], load_seconds=[1e-3],
                           warm_load_seconds=[1e-3], bit_exact=True)
    fractions = sb.limit_fractions(sb.TargetResult("/t", {}, 1, [padded, small]), small)
    # gdsckpt moved its 8 KiB file in the time raw I/O moved 4 KiB: twice the storage's pace
    assert fractions == pytest.approx(dict.fromkeys(("save", "load", "warm_load"), 2.0))


def test_recommendation_says_plainly_when_a_baseline_was_faster() -> None:
    chosen = _measurement("zstd", 2.0, 8 * 10**8, load_s=1.0)  # 0.5 GB/s save, 1.0 load, ratio 1.25
    torch_faster_save = sb.Measurement("torch", "baseline", "cpu", status="ok", logical_bytes=10**9,
                                       save_seconds=[1.25], load_seconds=[2.0], bit_exact=True)
    safetensors_slower = sb.Measurement("safetensors", "baseline", "cpu", status="ok", logical_bytes=10**9,
                                        save_seconds=[4.0], load_seconds=[1.5], bit_exact=True)
    result = sb.TargetResult("/t", {}, 1, [chosen, torch_faster_save, safetensors_slower])
    recommendation = sb.recommend(result)
    assert recommendation is not None and recommendation.measurement is chosen
    assert len(recommendation.baselines_faster) == 1
    statement = recommendation.baselines_faster[0]
    assert statement.startswith("torch saved faster") and "0.800 against 0.500 GB/s" in statement
    assert "compressing" in statement and recommendation.to_json()["baselines_faster"] == [statement]
    safetensors_slower.save_seconds = [1.0]  # now faster at saving too
    assert [s.split(" ")[0] for s in sb.recommend(result).baselines_faster] == ["torch", "safetensors"]
    text = bench.format_recommendation(sb.recommend(result), Path("/p.toml"))
    assert text.count("note: ") == 2


def test_format_size_round_trips_through_parse_size() -> None:
    for value in (4096, 64 << 10, 4 << 20, 3 << 30, 12345 * 4096, 1 << 40):
        assert parse_size(sb.format_size(value)) == value
    assert sb.format_size(4 << 20) == "4MiB" and sb.format_size(12288) == "12KiB"


def test_nonexistent_target_exits_1_and_creates_nothing(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "no-such-dir"
    code, stdout = run_bench("--target", str(missing), "--size", "1MiB", "--device", "cpu",
                             "--out", str(tmp_path / "out"))
    assert code == 1 and stdout == ""
    assert f"target {str(missing)!r} does not exist" in caplog.text
    assert not missing.exists() and not (tmp_path / "out").exists()


def test_target_without_room_exits_2_before_writing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import shutil

    too_big = shutil.disk_usage(tmp_path).free + (1 << 30)
    target = tmp_path / "small"
    target.mkdir()
    code, stdout = run_bench("--target", str(target), "--size", str(too_big), "--device", "cpu",
                             "--out", str(tmp_path / "out"))
    assert code == 2 and stdout == ""
    assert "free but the benchmark needs" in caplog.text and "choose a smaller --size" in caplog.text
    assert bench_files(target) == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [
    ("--codecs", "zstd,brotli"),
    ("--chunk-sizes", "5000"),
    ("--threads", "0"),
    ("--baselines", "pickle"),
    ("--size", "lots"),
    ("--max-seconds", "0"),
    ("--max-seconds", "inf"),  # bench.json held "Infinity", which is no JSON
    ("--max-seconds", "1e400"),
])
def test_bad_arguments_exit_2(tmp_path: Path, argv: tuple[str, ...],
                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        run_bench("--target", str(tmp_path), *argv)
    assert exited.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_several_targets_need_a_preset_pattern(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    code, _ = run_bench("--target", str(tmp_path), "--target", str(tmp_path), "--size", "1MiB",
                        "--device", "cpu", "--recommend", "--preset-out", str(tmp_path / "preset.toml"))
    assert code == 2 and "{target}" in caplog.text
    assert bench_files(tmp_path) == []


def test_cuda_requested_without_a_gpu_exits_2(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _ = run_bench("--target", str(tmp_path), "--size", "1MiB", "--device", "cuda")
    assert code == 2 and "device 'cuda' requested but" in caplog.text
    assert bench_files(tmp_path) == []


def test_ctrl_c_removes_every_bench_file(tmp_path: Path, h: Any) -> None:
    """A real SIGINT to a running ``gdsckpt bench`` process: exit 130, the target as it was."""
    target = tmp_path / "target"
    target.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-c", HARNESS, "--quiet", "bench", "--target", str(target), "--size", "4MiB",
         "--codecs", "none", "--chunk-sizes", "64KiB", "--threads", "2", "--repeats", "1000",
         "--device", "cpu", "--baselines", "none", "--out", str(tmp_path / "out")],
        env=h.subprocess_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None and not any(target.iterdir()):
            time.sleep(0.01)
        assert process.poll() is None, process.communicate()
        assert [path.name[:len(sb.WORKDIR_PREFIX)] for path in target.iterdir()] == [sb.WORKDIR_PREFIX]
        time.sleep(0.3)  # into the measurements (1000 rounds: it is still running)
        process.send_signal(signal.SIGINT)
        _stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr
    assert bench_files(target) == [], "every bench file is removed on Ctrl-C"
    assert not (tmp_path / "out").exists()


def test_interrupt_between_measurements_removes_the_files(tmp_path: Path) -> None:
    seen: list[list[Path]] = []

    def interrupt(_nbytes: int) -> None:
        seen.append(bench_files(tmp_path))
        raise KeyboardInterrupt

    settings = sb.BenchSettings(size_bytes=1 << 20, codecs=("none",), chunk_sizes=(64 << 10,), threads=(2,),
                                repeats=1, baselines=())
    with pytest.raises(KeyboardInterrupt):
        sb.run_benchmark(settings, [tmp_path], advance=interrupt)
    assert len(seen) == 1 and seen[0] and seen[0][0].name.startswith(sb.WORKDIR_PREFIX)
    assert bench_files(tmp_path) == []


def test_sigterm_interrupts_like_ctrl_c_while_the_benchmark_runs() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), bench._sigterm_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises in this thread long before
    assert signal.getsignal(signal.SIGTERM) is before


def test_time_budget_ends_the_run_with_partial_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-seconds: once a target's share of the budget is spent, configurations not measured
    yet are skipped and measured ones keep the repeats they have; the report is still complete."""
    settings = sb.BenchSettings(size_bytes=1 << 20, codecs=("zstd", "none"), chunk_sizes=(1 << 20,), threads=(2,),
                                repeats=3, device="cpu", baselines=(), max_seconds=3600)
    clock = {"now": 0.0}
    real = time.perf_counter
    runs: list[str] = []
    from gdsckpt.tools.storagebench import runner

    original = runner._run_once

    def run_once(case: Any, path: Path, sync: Any) -> None:
        original(case, path, sync)
        runs.append(case.measurement.label)
        if len(runs) == 5:  # round 1 (raw, zstd, none, null) and one of round 2 ran: the budget is spent
            clock["now"] = 7200.0

    monkeypatch.setattr(runner, "_run_once", run_once)
    monkeypatch.setattr(runner.time, "perf_counter", lambda: real() + clock["now"])
    report = sb.run_benchmark(settings, [tmp_path])
    measurements = report.targets[0].measurements
    assert len(runs) == 5 and all(m.status == "ok" for m in measurements)
    repeats = sorted(len(m.save_seconds) for m in measurements)
    assert repeats == [1, 1, 1, 2]
    partial = [m for m in measurements if len(m.save_seconds) == 1]
    assert all("of 3 repeats" in (m.reason or "") for m in partial)
    assert json.loads(json.dumps(report.to_json()))["targets"][0]["results"]
    skipped = sb.run_benchmark(dataclasses.replace(settings, max_seconds=1e-9), [tmp_path])
    assert {m.status for m in skipped.targets[0].measurements} == {"skipped"}
    assert all("time budget" in m.reason for m in skipped.targets[0].measurements)


def test_a_gpu_case_whose_codec_scratch_exceeds_the_staging_budget_is_skipped_with_why() -> None:
    """nvCOMP's Zstd holds about 1.1 GiB of scratch whatever the chunk size: a GPU case under the
    default 1 GiB budget would only be refused by the save, so it is skipped and says why; ANS
    under the same budget runs, and Zstd under a budget that holds its scratch runs too."""
    from gdsckpt.config import Config
    from gdsckpt.tools.storagebench import runner

    side = runner._Side(device="cuda", engine="gpu", state={}, tensors={}, raw=None, sync=lambda: None)
    refused = runner._gdsckpt_case(side, "zstd", 16 << 20, 4, None, Config(), 1 << 30)
    assert refused.measurement.status == "skipped"
    assert "nvCOMP's zstd holds 1120MiB" in refused.measurement.reason and "1GiB" in refused.measurement.reason
    for codec, budget in (("ans", 1 << 30), ("zstd", 2 << 30)):
        case = runner._gdsckpt_case(side, codec, 16 << 20, 4, None, Config(max_staging_bytes=budget), 1 << 30)
        assert case.measurement.status != "skipped" and case.save is not None, (codec, case.measurement.reason)


def test_bench_skips_a_gpu_auto_case_whose_save_would_be_refused() -> None:
    """With ``--depth`` the GPU budget is depth x chunk: ``--depth 4`` at 4 MiB chunks is 16 MiB,
    whose share holds no compressing codec's fixed nvCOMP scratch. ``auto`` (the first of the
    bench's default codecs) takes nvCOMP's ANS where nothing else fits, so its case is skipped with
    ANS's, not recorded as the save's refusal (it was: ``auto`` has no scratch entry of its own)."""
    from gdsckpt.config import Config
    from gdsckpt.tools.storagebench import runner

    side = runner._Side(device="cuda", engine="gpu", state={}, tensors={}, raw=None, sync=lambda: None)
    for codec in ("ans", "auto"):
        case = runner._gdsckpt_case(side, codec, 4 << 20, 4, 4, Config(), 1 << 20)
        assert case.measurement.status == "skipped", (codec, case.measurement.reason)
        assert "nvCOMP's ans holds 32MiB" in case.measurement.reason


def test_an_interrupt_a_library_turns_into_its_own_error_still_ends_the_run(tmp_path: Path) -> None:
    """torch.save's zip writer turns a Ctrl-C inside its write into ``RuntimeError: ... unexpected
    pos``: the configuration was recorded as failed and the run went on (exit 1, not 130). With
    the command's handler having seen the interrupt, the error is the interrupt again."""
    from gdsckpt.tools.storagebench import runner

    measurement = sb.Measurement("torch", "baseline", "cpu")

    def save(_path: Path) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    case = runner._Case(measurement, ".pt", save=save, load=lambda _p: None, check=lambda _x: True)
    runner._run_once(case, tmp_path / "x", lambda: None)
    assert measurement.status == "failed"  # no interrupt seen: one configuration failed
    sb.INTERRUPTED.set()
    try:
        with pytest.raises(KeyboardInterrupt):
            runner._run_once(case, tmp_path / "x", lambda: None)
    finally:
        sb.INTERRUPTED.clear()


def test_results_that_cannot_be_written_still_print_the_table(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """--out that cannot take bench.json (a full disk; here a directory where the file goes):
    the run's table was lost, an empty bench.json left and the error named no path."""
    out = tmp_path / "out"
    (out / "bench.json").mkdir(parents=True)
    target = tmp_path / "target"
    target.mkdir()
    code, stdout = run_bench("--target", str(target), "--size", "256KiB", "--codecs", "none", "--chunk-sizes",
                             "64KiB", "--threads", "1", "--repeats", "1", "--baselines", "none", "--device", "cpu",
                             "--out", str(out))
    assert code == 1
    assert "x limit" in stdout or "GB/s" in stdout, stdout
    assert any(str(out) in record.getMessage() and "cannot write the results" in record.getMessage()
               for record in caplog.records)
    assert sorted(p.name for p in out.iterdir()) == ["bench.json"] and (out / "bench.json").is_dir()


def test_a_run_that_measured_nothing_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """``--max-seconds`` spent before the first configuration: every one skipped, and the command
    exited 0, which its docstring keeps for runs whose configurations loaded bit-exact."""
    from gdsckpt.tools.storagebench import runner

    calls = {"n": 0}

    def clock() -> float:  # the budget is spent right after the run starts
        calls["n"] += 1
        return 0.0 if calls["n"] == 1 else 1e9

    monkeypatch.setattr(runner.time, "perf_counter", clock)
    target = tmp_path / "target"
    target.mkdir()
    code, stdout = run_bench("--target", str(target), "--size", "256KiB", "--codecs", "none", "--chunk-sizes",
                             "64KiB", "--threads", "1", "--repeats", "1", "--baselines", "none", "--device", "cpu",
                             "--max-seconds", "1", "--out", str(tmp_path / "out"))
    assert "skipped" in stdout
    assert code == 1 and any("no configuration was measured" in r.getMessage() for r in caplog.records)


def test_a_value_given_twice_is_one_configuration() -> None:
    """``--threads 2,2`` (or ``--chunk-sizes 1MiB,1024KiB``) ran the same configuration twice,
    each a row of its own in the table and the JSON."""
    parser = argparse.ArgumentParser(prog="gdsckpt")
    bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--target", "/tmp", "--threads", "2,2,4", "--chunk-sizes", "1MiB,1024KiB,64KiB",
                              "--depth", "default,2,default", "--repeats", "1"])
    assert args.threads == (2, 4) and args.chunk_sizes == (1 << 20, 64 << 10) and args.depth == (None, 2)


def test_a_configuration_failing_in_a_later_repeat_shows_no_figures(tmp_path: Path) -> None:
    """A configuration whose second repeat failed was shown with the first repeat's GB/s beside
    "failed" (the median of the repeats that finished); its figures are now None ("-" in the
    table) while the JSON keeps the finished repeats' seconds as measured."""
    from gdsckpt.tools.storagebench import runner

    measurement = sb.Measurement("torch", "baseline", "cpu", logical_bytes=10**6)
    calls = []

    def save(path: Path) -> dict[str, Any]:
        calls.append(path)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        path.write_bytes(b"x" * 1000)
        return {}

    case = runner._Case(measurement, ".pt", save=save, load=lambda _p: None, check=lambda _x: True)
    runner._run_once(case, tmp_path / "x", lambda: None)
    assert measurement.save_gbps is not None  # one good repeat: a figure
    runner._run_once(case, tmp_path / "x", lambda: None)
    assert measurement.status == "failed"
    assert (measurement.save_gbps, measurement.load_gbps, measurement.warm_load_gbps) == (None, None, None)
    doc = measurement.to_json()
    assert len(doc["save_seconds"]) == 1 and doc["save_gbps"] is None


def test_auto_learns_its_storage_and_pace_in_the_warm_up_not_in_a_timed_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU engine the warm-up saved 1 MiB, under the size codec auto weighs: the first timed
    auto save learned the codec's pace, the second then probed the storage (a durable write of up
    to 256 MiB) inside its timing (2.1 s against 0.03 s for the same save). The probe and the
    pace's first measurement belong to the warm-up."""
    from gdsckpt.pipeline import autotune
    from gdsckpt.tools.storagebench import runner

    timing: list[str] = []
    probed_in: list[str | None] = []

    def probe(directory: Path, nbytes: int | None = None, timeout: float | None = None) -> float:
        probed_in.append(timing[-1] if timing else None)
        return 2.0

    monkeypatch.setattr(autotune, "measure_storage_gbps", probe)
    real_run_once = runner._run_once

    def run_once(case: Any, path: Path, sync: Any) -> None:
        timing.append(case.measurement.label)
        try:
            real_run_once(case, path, sync)
        finally:
            timing.append("")

    monkeypatch.setattr(runner, "_run_once", run_once)
    target = tmp_path / "target"
    target.mkdir()
    settings = sb.BenchSettings(size_bytes=24 << 20, codecs=("auto",), chunk_sizes=(4 << 20,), threads=(2,),
                                repeats=2, baselines=(), device="cpu")
    report = sb.run_benchmark(settings, [target])
    assert all(m.status == "ok" for m in report.targets[0].measurements)
    assert probed_in == [None]  # once, before any timed save


def test_the_warm_up_saves_with_the_codec_asked_for_whatever_the_config_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """save's codec="auto" argument defers to a configuration's codec: the warm-up of "auto" under
    a config naming lz4 (or, with --config fast-nvme on a CPU host, ans: the warm-up failed) ran
    the config's codec, and the first timed save paid auto's first-use costs."""
    from gdsckpt.tools.storagebench import runner

    warmed: list[str] = []
    real_save = gdsckpt.api.save

    def spy(state: Any, path: Any, **kwargs: Any) -> Any:
        report = real_save(state, path, **kwargs)
        if str(path).endswith("warm-up.gdsckpt"):
            warmed.append(report.codec)
        return report

    monkeypatch.setattr(gdsckpt.api, "save", spy)
    settings = sb.BenchSettings(size_bytes=1 << 20, codecs=("auto",), chunk_sizes=(1 << 20,), threads=(1,),
                                repeats=1, baselines=(), device="cpu", config=gdsckpt.Config(codec="lz4"))
    side = runner._Side.__new__(runner._Side)
    side.engine, side.device, side.tensors = "cpu", "cpu", {"w": torch_zeros(1 << 18)}
    runner._warm_up(side, tmp_path, settings)
    auto_codec = real_save(side.tensors, tmp_path / "direct.gdsckpt", codec="auto", config=gdsckpt.Config()).codec
    assert auto_codec != "lz4" and warmed == [auto_codec]


def torch_zeros(n: int) -> Any:
    import torch

    return torch.zeros(n)


def test_recommend_weighs_only_configurations_of_every_round_that_ran() -> None:
    """--max-seconds ended the rounds after one configuration's first repeat: its single sample
    (status ok, "1 of 3 repeats") beat medians of three and was recommended."""
    from gdsckpt.tools.storagebench.runner import _out_of_time

    full = _measurement("zstd", 1.0, 8 * 10**8, save_seconds=[1.0, 1.0, 1.0], load_seconds=[1.0] * 3)
    partial = _measurement("lz4", 0.5, 8 * 10**8)
    _out_of_time(partial, 3)
    assert partial.status == "ok" and "1 of 3" in (partial.reason or "")
    chosen = sb.recommend(sb.TargetResult("/t", {}, 1, [full, partial]))
    assert chosen is not None and chosen.measurement is full
    # every configuration cut short alike: the rounds that ran are compared
    full.save_seconds = [1.0]
    assert sb.recommend(sb.TargetResult("/t", {}, 1, [full, partial])).measurement is partial


def test_a_recommended_storage_speed_never_rounds_to_zero() -> None:
    """A raw write of 3.9 kB/s (a tiny or slow run) was written as storage_gbps = 0.0, which the
    preset's own Config.from_toml refused."""
    raw = sb.Measurement("raw-posix", "raw", "cpu", chunk_bytes=4 << 20, threads=8, status="ok",
                         logical_bytes=14, file_bytes=14, save_seconds=[14 / 3909], load_seconds=[0.001],
                         bit_exact=True)
    result = sb.TargetResult("/t", {}, 1, [raw, _measurement("zstd", 1.0, 8 * 10**8)])
    chosen = sb.recommend(result)
    assert chosen is not None and chosen.fields["storage_gbps"] == pytest.approx(3.909e-6)
    assert gdsckpt.Config(**chosen.fields).storage_gbps == pytest.approx(3.909e-6)  # what the preset holds


def test_out_through_a_dangling_symlink_is_refused_before_measuring(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The up-front check walked past a dangling link (it does not "exist"), the whole run went
    by, then mkdir failed ("File exists") and the results were lost."""
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "missing" / "x")
    code, stdout = run_bench("--target", str(target), "--size", "256KiB", "--codecs", "none", "--chunk-sizes",
                             "64KiB", "--threads", "1", "--repeats", "1", "--baselines", "none", "--device", "cpu",
                             "--out", str(tmp_path / "out"))
    assert code == 2 and "GB/s" not in stdout
    assert "cannot be created" in caplog.text


def test_a_preset_that_cannot_be_written_leaves_nothing_and_names_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A full disk (injected) while writing the --recommend preset left an empty file, which
    Config.from_toml reads as no settings, and the error named no path."""
    from gdsckpt.io import posix

    target = tmp_path / "target"
    target.mkdir()
    preset = tmp_path / "presets" / "p.toml"
    real_write = posix.write_atomically

    def full_disk(path: Any, data: bytes, **kwargs: Any) -> None:
        if str(path).endswith(".toml"):
            with open(path, "wb") as file:  # what a plain write leaves: the file, cut short
                file.write(data[:0])
            os.unlink(path)
            raise OSError(28, "No space left on device")
        real_write(path, data, **kwargs)

    monkeypatch.setattr(bench, "write_atomically", full_disk)
    code, _stdout = run_bench("--target", str(target), "--size", "256KiB", "--codecs", "none", "--chunk-sizes",
                              "64KiB", "--threads", "1", "--repeats", "1", "--baselines", "none", "--device",
                              "cpu", "--out", str(tmp_path / "out"), "--recommend", "--preset-out", str(preset))
    assert code == 1
    assert not preset.exists()
    assert any(str(preset) in r.getMessage() and "No space left" in r.getMessage() for r in caplog.records)
