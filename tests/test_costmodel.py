"""The checkpoint cost model (``gdsckpt.tools.costmodel``) and ``gdsckpt plan`` (``gdsckpt.cli.plan``).

Expected figures are worked out by hand in the comments next to them, from the model's formulas
(stall = bytes / speed; GPU-hours a month = stall x checkpoints a month x GPUs / 3600), not from
the implementation. ``plan`` is reached through its ``register()``ed subparser, as the ``gdsckpt``
command will wire it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import gdsckpt
from gdsckpt.cli import plan as plan_cli
from gdsckpt.tools import costmodel
from gdsckpt.tools.costmodel import Job, ModelSpec

GB = 1e9


def uniform(spec: ModelSpec, ratio: float) -> list[costmodel.Part]:
    """``spec``'s parts, all compressing ``ratio``:1 (round numbers to compute by hand)."""
    parts = costmodel.checkpoint_parts(spec)
    return costmodel.with_ratios(parts, {part.name: ratio for part in parts}, "test")


# A 1B-parameter mixed-precision AdamW model: bf16 weights 2 GB + fp32 master 4 GB + exp_avg 4 GB
# + exp_avg_sq 4 GB = 14 GB; at ratio 1.25 everywhere, 11.2 GB stored.
ONE_B = ModelSpec(1_000_000_000)
JOB = Job(interval_s=1800, gpus=8, storage_gbps=2.0, gpu_hour_price=2.5, keep_last=3,
          pipeline_gbps_per_gpu=40.0, background_slowdown=0.25)


# ---------------------------------------------------------------------------------------------
# the checkpoint's parts

def test_mixed_precision_adamw_parts_and_measured_ratios() -> None:
    parts = {part.name: part for part in costmodel.checkpoint_parts(ONE_B)}
    assert [(name, part.dtype, part.nbytes) for name, part in parts.items()] == [
        ("weights", "bf16", 2 * 10**9), ("master", "fp32", 4 * 10**9),
        ("exp_avg", "fp32", 4 * 10**9), ("exp_avg_sq", "fp32", 4 * 10**9)]
    # docs/performance.md, H200: bf16 1.546, fp32 master 1.215, exp_avg 1.192, exp_avg_sq 1.230
    assert {name: part.ratio for name, part in parts.items()} == {
        "weights": 1.546, "master": 1.215, "exp_avg": 1.192, "exp_avg_sq": 1.230}
    assert parts["weights"].stored_bytes == pytest.approx(2e9 / 1.546)


def test_other_optimizers_dtypes_and_gradients() -> None:
    sgd = costmodel.checkpoint_parts(ModelSpec(10**6, weights="fp32", master=None, optimizer="sgd"))
    # fp32 weights 4 MB at the fp32 master's ratio; one fp32 momentum buffer at exp_avg's ratio
    assert [(p.name, p.nbytes, p.ratio) for p in sgd] == [("weights", 4 * 10**6, 1.215),
                                                          ("momentum_buffer", 4 * 10**6, 1.192)]
    bare = costmodel.checkpoint_parts(ModelSpec(10**6, weights="fp16", master=None, optimizer="none",
                                                grads="bf16"))
    # nothing measured for fp16 weights or gradients: counted incompressible
    assert [(p.name, p.dtype, p.nbytes, p.ratio) for p in bare] == [("weights", "fp16", 2 * 10**6, 1.0),
                                                                    ("grads", "bf16", 2 * 10**6, 1.0)]


def test_nvidia_blog_70b_checkpoint() -> None:
    """The post's example: 70B parameters, bf16 weights, two fp32 AdamW moments and bf16
    gradients = 70e9 x (2 + 8 + 2) = 840e9 bytes (the post's "782 GB" is 782.3 GiB), written
    every 30 minutes at 5 GB/s on 8 GPUs at $4.40 a GPU-hour."""
    parts = costmodel.checkpoint_parts(ModelSpec(70 * 10**9, master=None, grads="bf16"))
    assert costmodel.logical_bytes(parts) == 840 * 10**9
    assert costmodel.logical_bytes(parts) / 2**30 == pytest.approx(782.3, abs=0.05)
    base = costmodel.plan(parts, Job(interval_s=1800, gpus=8, storage_gbps=5.0, gpu_hour_price=4.40)).baseline
    assert base.write_s == pytest.approx(168.0)                  # 840e9 / 5e9
    assert base.job.checkpoints_per_month == pytest.approx(1440)  # 48 a day x 30 days
    assert base.gpu_hours_per_month == pytest.approx(537.6)      # 168 x 1440 x 8 / 3600
    assert base.cost_per_month == pytest.approx(2365.44)         # 537.6 x 4.40


def test_with_ratios_rejects_unknown_parts_and_bad_ratios() -> None:
    parts = costmodel.checkpoint_parts(ONE_B)
    with pytest.raises(ValueError, match="no part named 'momentum_buffer'.*weights, master, exp_avg"):
        costmodel.with_ratios(parts, {"momentum_buffer": 1.1}, "test")
    with pytest.raises(ValueError, match="must be > 0"):
        costmodel.with_ratios(parts, {"exp_avg": 0.0}, "test")


@pytest.mark.parametrize("changes, message", [
    ({"params": 0}, "params must be > 0"),
    ({"weights": "int8"}, "weights='int8' is not a known dtype"),
    ({"optimizer": "adam"}, "optimizer='adam' is not known"),
])
def test_model_spec_rejects_bad_values(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelSpec(**({"params": 10} | changes))


@pytest.mark.parametrize("changes, message", [
    ({"interval_s": 0}, "interval_s must be > 0"),
    ({"storage_gbps": -1.0}, "storage_gbps must be > 0"),
    ({"gpus": 0}, "gpus and keep_last must be >= 1"),
    ({"writers": 9}, r"writers must be between 1 and gpus \(8\)"),
    ({"snapshot": "disk"}, "snapshot='disk' is invalid"),
    ({"gpu_hour_price": -2.0}, "gpu_hour_price must be >= 0"),
    ({"background_slowdown": -0.1}, "background_slowdown must be >= 0"),
])
def test_job_rejects_bad_values(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Job(**({"interval_s": 60, "gpus": 8, "storage_gbps": 1.0} | changes))


# ---------------------------------------------------------------------------------------------
# the scenarios

def test_scenarios_hand_computed() -> None:
    base, sync, dcp, asynchronous = costmodel.plan(uniform(ONE_B, 1.25), JOB).scenarios
    assert dcp.name == "DCP async_save"
    assert JOB.checkpoints_per_month == pytest.approx(1440)  # 720 h x 3600 / 1800 s

    # without gdsckpt: 14 GB at 2 GB/s = 7 s; 7 x 1440 x 8 / 3600 = 22.4 GPU-hours, x $2.5 = $56
    assert (base.write_s, base.blocked_s, base.bound) == (pytest.approx(7.0), pytest.approx(7.0), "storage")
    assert base.gpu_hours_per_month == pytest.approx(22.4)
    assert base.cost_per_month == pytest.approx(56.0)
    assert base.lost_fraction == pytest.approx(7 / 1800)
    assert base.storage_bytes == pytest.approx(42 * GB)              # 14 GB x 3 kept
    assert base.written_bytes_per_month == pytest.approx(20.16e12)   # 14 GB x 1440

    # gdsckpt sync: 11.2 GB at 2 GB/s = 5.6 s (compression: 14 GB / (40 GB/s x 8) = 0.044 s, not the bound)
    assert (sync.write_s, sync.blocked_s, sync.bound) == (pytest.approx(5.6), pytest.approx(5.6), "storage")
    assert sync.gpu_hours_per_month == pytest.approx(17.92)          # 5.6 x 1440 x 8 / 3600
    assert sync.cost_per_month == pytest.approx(44.8)
    assert sync.storage_bytes == pytest.approx(33.6 * GB)
    assert sync.written_bytes_per_month == pytest.approx(16.128e12)

    # gdsckpt async: each of 8 writers snapshots 14/8 = 1.75 GB; that exceeds 1 GiB, so pinned at
    # 50.8 GB/s: 0.034449 s blocked; the 5.6 s save behind training costs 0.25 x 5.6 = 1.4 s
    assert asynchronous.snapshot == "pinned"
    assert asynchronous.blocked_s == pytest.approx(1.75 / 50.8)
    assert asynchronous.background_s == pytest.approx(1.4)
    assert asynchronous.backlog_s == 0.0
    assert asynchronous.lost_s == pytest.approx(1.434448819)
    assert asynchronous.gpu_hours_per_month == pytest.approx(4.590236220)  # 1.434449 x 1440 x 8 / 3600
    assert asynchronous.cost_per_month == pytest.approx(11.47559055)
    assert asynchronous.storage_bytes == pytest.approx(33.6 * GB)

    # DCP async_save, pinned staging: each writer stages 1.75 GB at 50.5 GB/s; the uncompressed
    # 14 GB are written behind training in 7 s at no measured cost to it
    assert (dcp.snapshot, dcp.stored_bytes) == ("pinned", pytest.approx(14 * GB))
    assert dcp.blocked_s == pytest.approx(1.75 / 50.5)
    assert (dcp.write_s, dcp.background_s, dcp.backlog_s) == (pytest.approx(7.0), 0.0, 0.0)
    assert dcp.gpu_hours_per_month == pytest.approx(1.75 / 50.5 * 1440 * 8 / 3600)
    assert dcp.storage_bytes == pytest.approx(42 * GB)


def test_async_gain_compares_gdsckpt_async_with_dcp_async_save() -> None:
    """The gain of gdsckpt itself: its async save against DCP's, not against a synchronous save."""
    result = costmodel.plan(uniform(ONE_B, 1.25), JOB)
    gain = result.async_gain()
    dcp, ours = result.scenario("DCP async_save"), result.scenario("gdsckpt async")
    assert gain["gpu_hours_per_month"] == pytest.approx(dcp.gpu_hours_per_month - ours.gpu_hours_per_month)
    assert gain["gpu_hours_per_month"] < 0  # the measured slowdown behind training costs more than DCP's
    assert gain["storage_bytes"] == pytest.approx(8.4 * GB)  # (14 - 11.2) GB x 3 kept
    assert gain["cost_per_month"] == pytest.approx(dcp.cost_per_month - ours.cost_per_month)
    pageable = costmodel.plan(uniform(ONE_B, 1.25), Job(interval_s=1800, gpus=8, storage_gbps=2.0,
                                                        dcp_staging="pageable"))
    assert pageable.scenario("DCP async_save").blocked_s == pytest.approx(1.75 / 1.74)
    assert pageable.scenario("DCP async_save").blocked_s > pageable.scenario("gdsckpt async").blocked_s
    with pytest.raises(ValueError, match="dcp_staging='disk' is invalid"):
        Job(interval_s=1800, gpus=8, storage_gbps=2.0, dcp_staging="disk")


def test_no_price_gives_no_money() -> None:
    job = Job(interval_s=1800, gpus=8, storage_gbps=2.0)
    assert all(s.cost_per_month is None for s in costmodel.plan(uniform(ONE_B, 1.25), job).scenarios)


def test_pipeline_bounds_a_save_on_fast_storage() -> None:
    # 1 TB/s storage, one writer compressing at 40 GB/s: 11.2 GB / 1000 GB/s = 0.0112 s at the
    # storage, but 14 GB / 40 GB/s = 0.35 s through the compressor
    job = Job(interval_s=1800, gpus=8, storage_gbps=1000.0, writers=1, pipeline_gbps_per_gpu=40.0)
    sync = costmodel.gdsckpt_sync(uniform(ONE_B, 1.25), job)
    assert (sync.write_s, sync.bound) == (pytest.approx(0.35), "pipeline")
    # a single writer snapshots the whole 14 GB: 14 / 50.8 s
    assert costmodel.gdsckpt_async(uniform(ONE_B, 1.25), job).blocked_s == pytest.approx(14 / 50.8)


def test_observed_torch_save_speed_sets_the_baseline() -> None:
    job = Job(interval_s=1800, gpus=8, storage_gbps=2.0, torch_save_gbps=0.5)
    base = costmodel.without_gdsckpt(uniform(ONE_B, 1.25), job)
    assert (base.write_s, base.bound) == (pytest.approx(28.0), "torch.save")  # 14 GB / 0.5 GB/s


def test_gpu_snapshot_when_the_shard_fits() -> None:
    # 16 writers: 14 GB / 16 = 0.875 GB per shard <= 1 GiB, so copied on the GPU at 261 GB/s
    job = Job(interval_s=1800, gpus=16, storage_gbps=2.0)
    asynchronous = costmodel.gdsckpt_async(uniform(ONE_B, 1.25), job)
    assert asynchronous.snapshot == "gpu"
    assert asynchronous.blocked_s == pytest.approx(0.875 / 261)
    forced = costmodel.gdsckpt_async(uniform(ONE_B, 1.25), Job(interval_s=1800, gpus=16, storage_gbps=2.0,
                                                                snapshot="pinned", snapshot_gbps=25.0))
    assert (forced.snapshot, forced.blocked_s) == ("pinned", pytest.approx(0.875 / 25))


def test_async_save_longer_than_the_interval_backs_up() -> None:
    # a 5.6 s save every 4 s: each call waits 1.6 s for the previous save; the save overlaps the
    # whole 4 s of training, costing 0.25 x 4 = 1 s
    job = Job(interval_s=4, gpus=8, storage_gbps=2.0, snapshot_gbps=50.0)
    asynchronous = costmodel.gdsckpt_async(uniform(ONE_B, 1.25), job)
    assert asynchronous.backlog_s == pytest.approx(1.6)
    assert asynchronous.blocked_s == pytest.approx(1.75 / 50 + 1.6)
    assert asynchronous.background_s == pytest.approx(1.0)


def test_plan_json_round_trips() -> None:
    doc = json.loads(json.dumps(costmodel.plan(uniform(ONE_B, 1.25), JOB).to_json()))
    assert doc["logical_bytes"] == 14 * 10**9
    assert doc["ratio"] == pytest.approx(1.25)
    assert list(doc["scenarios"]) == ["without_gdsckpt", "gdsckpt_sync", "dcp_async_save", "gdsckpt_async"]
    assert list(doc["savings"]) == ["gdsckpt_sync", "gdsckpt_async"]
    assert doc["async_gain_over_dcp_async_save"]["storage_bytes"] == pytest.approx(8.4e9)
    assert doc["scenarios"]["gdsckpt_sync"]["gpu_hours_per_month"] == pytest.approx(17.92)
    assert doc["job"]["shard_writers"] == 8


# ---------------------------------------------------------------------------------------------
# ratios from a real checkpoint

def test_group_of_follows_gpu_bench() -> None:
    assert costmodel.group_of("optimizer/state/3/exp_avg") == "optimizer/exp_avg"
    assert costmodel.group_of("model/layers.0.weight") == "model"
    assert costmodel.group_of("step") == "step"


@pytest.fixture
def training_checkpoint(tmp_path: Path, h: Any) -> Path:
    """A small mixed-precision AdamW state: bf16 weights of zeros (compress far), fp32 master and
    exp_avg_sq of random normals (barely compress), exp_avg of zeros; weights tied under ``tied``."""
    g = torch.Generator().manual_seed(0)
    weights = torch.zeros(4096, dtype=torch.bfloat16)
    state = {
        "model": {"w": weights},
        "master": {"w": torch.randn(4096, generator=g)},
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(4096), "exp_avg_sq": torch.randn(4096, generator=g),
                                    "step": torch.tensor(3.0)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "tied": weights,
    }
    path = tmp_path / "train.gdsckpt"
    # a named codec: auto would store chunks as they are whenever this fast disk waits for zstd
    gdsckpt.save(state, path, codec="zstd", config=h.small_config())
    return path


def test_group_sizes_of_a_real_checkpoint(training_checkpoint: Path) -> None:
    groups = costmodel.group_sizes(training_checkpoint)
    # the tied alias is stored once and counted once; param_groups hold no arrays
    assert {name: (g.nbytes, g.dtypes) for name, g in groups.items()} == {
        "model": (8192, ("bf16",)), "master": (16384, ("fp32",)),
        "optimizer/exp_avg": (16384, ("fp32",)), "optimizer/exp_avg_sq": (16384, ("fp32",)),
        "optimizer/step": (4, ("fp32",))}
    assert groups["model"].ratio > 10 and groups["optimizer/exp_avg"].ratio > 10  # zeros
    assert 0.9 < groups["master"].ratio < 1.5 and 0.9 < groups["optimizer/exp_avg_sq"].ratio < 1.5
    info = gdsckpt.inspect(training_checkpoint)
    assert sum(g.stored_bytes for g in groups.values()) == sum(t.stored_bytes for t in info.tensors
                                                                if t.alias_of is None)


# ---------------------------------------------------------------------------------------------
# the command line

def parse(*argv: str) -> argparse.Namespace:
    """``argv`` parsed by a ``gdsckpt``-like parser with ``plan`` registered and a global ``--quiet``."""
    parser = argparse.ArgumentParser(prog="gdsckpt")
    parser.add_argument("--quiet", action="store_true")
    subparsers = parser.add_subparsers(dest="command", required=True)
    plan_cli.register(subparsers)
    return parser.parse_args(list(argv))


def run(*argv: str, config: gdsckpt.Config | None = None) -> int:
    """Parse ``argv`` and run it; ``config`` stands for the global ``--config``."""
    args = parse(*argv)
    if config is not None:
        args.config = config
    return args.run(args)


@pytest.mark.parametrize("text, count", [
    ("7e9", 7 * 10**9), ("7B", 7 * 10**9), ("7b", 7 * 10**9), ("70M", 70 * 10**6), ("1.5T", 15 * 10**11),
    ("125k", 125_000), ("7000000000", 7 * 10**9), ("0.5G", 5 * 10**8), ("1.1e9", 11 * 10**8),
])
def test_parse_count(text: str, count: int) -> None:
    assert plan_cli.parse_count(text) == count


@pytest.mark.parametrize("text", ["abc", "0", "-5", "1.5", "7X", "", "B", "1e-3", "1e1000000"])
def test_parse_count_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        plan_cli.parse_count(text)


@pytest.mark.parametrize("text, seconds", [
    ("30m", 1800), ("2h", 7200), ("1800s", 1800), ("1800", 1800), ("1.5h", 5400), ("1d", 86400),
    ("45min", 2700), ("90 sec", 90),
])
def test_parse_duration(text: str, seconds: float) -> None:
    assert plan_cli.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["0m", "30x", "-1h", "m", "", "1e3s", "9" * 400, "0." + "0" * 300 + "1s"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        plan_cli.parse_duration(text)


HAND_JOB = ("--params", "1B", "--ratio", "weights=1.25", "--ratio", "master=1.25", "--ratio", "exp_avg=1.25",
            "--ratio", "exp_avg_sq=1.25", "--interval", "30m", "--gpus", "8", "--storage-gbps", "2",
            "--gpu-hour-price", "2.5", "--pipeline-gbps", "40")


def test_cli_json_matches_the_hand_computed_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("plan", *HAND_JOB, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    scenarios = doc["scenarios"]
    assert doc["logical_bytes"] == 14 * 10**9 and doc["compressed_bytes"] == pytest.approx(11.2e9)
    assert scenarios["without_gdsckpt"]["cost_per_month"] == pytest.approx(56.0)
    assert scenarios["gdsckpt_sync"]["cost_per_month"] == pytest.approx(44.8)
    assert scenarios["gdsckpt_async"]["gpu_hours_per_month"] == pytest.approx(4.590236220)
    assert doc["savings"]["gdsckpt_sync"]["cost_per_month"] == pytest.approx(11.2)      # 56 - 44.8
    assert doc["savings"]["gdsckpt_async"]["storage_bytes"] == pytest.approx(8.4e9)     # (14 - 11.2) x 3
    assert [p["ratio_source"] for p in doc["parts"]] == ["--ratio"] * 4


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("plan", *HAND_JOB) == 0
    out = capsys.readouterr().out
    assert "checkpoint of 1B parameters: bf16 weights, fp32 master copy, AdamW: 14.0 GB" in out
    assert "8 GPUs writing a shard each, storage 2 GB/s, 3 kept, $2.5 a GPU-hour" in out
    cost = next(line for line in out.splitlines() if line.startswith("cost a month"))
    assert cost.split()[3:] == ["$56.00", "$44.80", "$0.28", "$11.48"]
    assert "gdsckpt sync: 4.48 GPU-hours ($11.20) a month and 8.40 GB of storage less" in out
    assert ("gdsckpt async against DCP async_save (pinned staging), the gain of gdsckpt itself: 4.48 "
            "GPU-hours ($11.20) a month more and 8.40 GB of storage less") in out


def test_cli_quiet_prints_only_the_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("--quiet", "plan", *HAND_JOB) == 0
    out = capsys.readouterr().out
    assert "cost a month" in out
    assert "checkpoint of" not in out and "job:" not in out and "measured" not in out


def test_cli_fp32_weights_default_to_no_master_copy(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("plan", "--params", "1M", "--weights", "fp32", "--json") == 0
    parts = json.loads(capsys.readouterr().out)["parts"]
    assert [(p["name"], p["nbytes"]) for p in parts] == [("weights", 4 * 10**6), ("exp_avg", 4 * 10**6),
                                                        ("exp_avg_sq", 4 * 10**6)]


def test_cli_storage_speed_from_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("plan", "--params", "1B", "--json", config=gdsckpt.Config(storage_gbps=4.0)) == 0
    base = json.loads(capsys.readouterr().out)["scenarios"]["without_gdsckpt"]
    assert base["write_s"] == pytest.approx(3.5)  # 14 GB / 4 GB/s


@pytest.mark.parametrize("argv", [
    ("plan", "--params", "abc"), ("plan", "--params", "7B", "--interval", "30x"),
    ("plan", "--params", "7B", "--gpus", "0"), ("plan", "--params", "7B", "--snapshot", "disk"),
    ("plan", "--params", "7B", "--ratio", "exp_avg"), ("plan", "--params", "7B", "--storage-gbps", "inf"),
    ("plan", "--params", "7B", "--gpu-hour-price", "-1"), ("plan", "--params", "7B", "--optimizer", "adam"),
    # tiny positive figures made the plan's times inf and its savings nan
    ("plan", "--params", "7B", "--ratio", "weights=1e-300"), ("plan", "--params", "1e18", "--storage-gbps", "1e-300"),
    ("plan", "--params", "1e18", "--pipeline-gbps", "1e-300"),
])
def test_cli_unparsable_arguments_exit_2(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(*argv)
    assert exited.value.code == 2
    assert "error: argument" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (("plan",), "give --params"),
    (("plan", "--params", "7B", "--ratio", "momentum_buffer=1.2"), "no part named 'momentum_buffer'"),
    (("plan", "--params", "7B", "--gpus", "8", "--writers", "9"), "writers must be between 1 and gpus"),
])
def test_cli_arguments_that_make_no_plan_exit_2(argv: tuple[str, ...], message: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    assert run(*argv) == 2
    assert message in caplog.text


def test_cli_from_checkpoint_gives_ratios_to_the_model(training_checkpoint: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    groups = costmodel.group_sizes(training_checkpoint)
    assert run("plan", "--params", "1B", "--from", str(training_checkpoint), "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    parts = {p["name"]: p for p in doc["parts"]}
    assert parts["weights"]["nbytes"] == 2 * 10**9  # the size is the model's, the ratio the checkpoint's
    assert parts["weights"]["ratio"] == pytest.approx(groups["model"].ratio)
    assert parts["master"]["ratio"] == pytest.approx(groups["master"].ratio)
    assert parts["exp_avg"]["ratio"] == pytest.approx(groups["optimizer/exp_avg"].ratio)
    assert parts["exp_avg_sq"]["ratio"] == pytest.approx(groups["optimizer/exp_avg_sq"].ratio)
    assert parts["weights"]["ratio_source"] == f"from {training_checkpoint} (model bf16)"
    assert doc["from"] == str(training_checkpoint)


def test_cli_from_checkpoint_alone_plans_its_own_parts(training_checkpoint: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert run("plan", "--from", str(training_checkpoint), "--ratio", "master=2", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(p["name"], p["nbytes"]) for p in doc["parts"]] == [
        ("master", 16384), ("model", 8192), ("optimizer/exp_avg", 16384), ("optimizer/exp_avg_sq", 16384),
        ("optimizer/step", 4)]
    assert doc["logical_bytes"] == 8192 + 3 * 16384 + 4
    assert doc["parts"][0]["ratio"] == 2.0


def test_cli_from_checkpoint_alone_rejects_model_flags(training_checkpoint: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    assert run("plan", "--from", str(training_checkpoint), "--weights", "fp32") == 2
    assert "--weights describe a model given by --params" in caplog.text


def test_cli_from_missing_or_damaged_checkpoint_exits_1(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert run("plan", "--from", str(tmp_path / "missing.gdsckpt")) == 1
    junk = tmp_path / "junk.gdsckpt"
    junk.write_bytes(b"not a checkpoint" * 100)
    assert run("plan", "--params", "1B", "--from", str(junk)) == 1
    assert "missing.gdsckpt" in caplog.text


def test_cli_from_checkpoint_without_known_groups_warns_and_keeps_defaults(
        tmp_path: Path, h: Any, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "other.gdsckpt"
    gdsckpt.save({"net": {"w": torch.zeros(4096)}}, path, config=h.small_config())
    assert run("plan", "--params", "1M", "--from", str(path), "--json") == 0
    parts = json.loads(capsys.readouterr().out)["parts"]
    assert [p["ratio"] for p in parts] == [1.546, 1.215, 1.192, 1.230]
    assert "no group of" in caplog.text and "its groups: net" in caplog.text


def test_cli_from_reads_the_checkpoint_with_the_commands_config(training_checkpoint: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``gdsckpt --config FILE plan --from CKPT`` read the checkpoint with the environment's
    configuration: a config file's ``s3_endpoint`` or ``timeout`` was dropped for ``--from s3://``."""
    import gdsckpt.api

    seen: list[Any] = []
    real_inspect = gdsckpt.api.inspect

    def spy(path: Any, *, config: Any = None) -> Any:
        seen.append(config)
        return real_inspect(path, config=config)

    monkeypatch.setattr(gdsckpt.api, "inspect", spy)
    config = gdsckpt.Config(timeout=123, s3_endpoint="http://127.0.0.1:9")
    assert run("plan", "--from", str(training_checkpoint), "--json", config=config) == 0
    assert seen == [config]


def test_cli_from_a_delta_is_refused_with_one_line(training_checkpoint: Path, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """It escaped ``plan`` as a bare ``ValueError``; now an unusable file's message (exit 1)."""
    state = gdsckpt.load(training_checkpoint)
    delta = tmp_path / "delta.gdsckpt"
    gdsckpt.save(state, delta, base=training_checkpoint)
    assert run("plan", "--from", str(delta)) == 1
    assert "delta checkpoint" in caplog.text and "rebase" in caplog.text
