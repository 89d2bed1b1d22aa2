"""Portable mode (``portable=True``, ``Config.portable``, ``GDSCKPT_PORTABLE``): a save writes only
codecs that decode without a GPU, refuses a GPU-only codec before anything is written, and keeps
CUDA state on the CPU engine (``choose_save_engine``). The engine rule runs here on every
combination; saving real CUDA state through it is a GPU-host test (``tests/gpu``)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import gdsckpt
from gdsckpt.api.resolve import choose_save_engine
from gdsckpt.state import flatten


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(4096, generator=g), "h": torch.randn(300, generator=g).to(torch.bfloat16),
            "step": 7}


# -- the setting -------------------------------------------------------------------------------

def test_portable_is_a_config_field_with_an_environment_variable() -> None:
    assert gdsckpt.Config().portable is False
    assert gdsckpt.Config.from_env({"GDSCKPT_PORTABLE": "1"}).portable is True
    assert gdsckpt.Config.from_env({"GDSCKPT_PORTABLE": "false"}).portable is False
    with pytest.raises(ValueError, match="GDSCKPT_PORTABLE"):
        gdsckpt.Config.from_env({"GDSCKPT_PORTABLE": "maybe"})
    with pytest.raises(ValueError, match="portable must be True or False"):
        gdsckpt.Config(portable="yes")  # type: ignore[arg-type]


def test_portable_in_a_config_file(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("portable = true\n")
    assert gdsckpt.Config.from_toml(toml, base=gdsckpt.Config()).portable is True


# -- the engine rule ---------------------------------------------------------------------------

@pytest.mark.parametrize(("engine", "portable", "codec", "on_gpu", "usable", "expected"), [
    ("auto", False, "auto", True, True, "gpu"),
    ("auto", False, "zstd", True, True, "cpu"),  # nvCOMP's Zstd is the slower path for CUDA state
    ("auto", False, "lz4", True, True, "cpu"),
    ("auto", False, "deflate", True, True, "cpu"),
    ("auto", False, "ans", True, True, "gpu"),
    ("gpu", False, "zstd", True, True, "gpu"),
    ("auto", True, "auto", True, True, "cpu"),
    ("auto", True, "zstd", True, True, "cpu"),
    ("auto", True, "lz4", True, True, "cpu"),
    ("auto", True, "deflate", True, True, "cpu"),
    ("auto", True, "none", True, True, "gpu"),  # nothing to compress: kvikio writes the raw bytes
    ("auto", True, "auto", False, True, "cpu"),
    ("auto", False, "auto", True, False, "cpu"),
    ("gpu", True, "auto", True, True, "gpu"),
    ("gpu", True, "zstd", False, True, "gpu"),
    ("cpu", False, "auto", True, True, "cpu"),
])
def test_save_engine_rule(engine: str, portable: bool, codec: str, on_gpu: bool, usable: bool,
                          expected: str) -> None:
    config = gdsckpt.Config(engine=engine, portable=portable)
    chosen, why = choose_save_engine(config, codec, on_gpu, usable)
    assert chosen == expected and why


@pytest.mark.parametrize("codec", ["ans", "bitcomp", "gdeflate", "snappy", "cascaded"])
@pytest.mark.parametrize("engine", ["auto", "cpu", "gpu"])
def test_portable_refuses_every_gpu_only_codec_whatever_the_engine(codec: str, engine: str) -> None:
    with pytest.raises(ValueError, match=f"codec '{codec}' has no CPU decoder.*zstd, lz4, deflate, none"):
        choose_save_engine(gdsckpt.Config(engine=engine, portable=True), codec, True, True)


# -- saves ---------------------------------------------------------------------------------------

def test_gpu_only_codec_with_portable_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    path = tmp_path / "a.gdsckpt"
    gdsckpt.save({"old": torch.ones(3)}, path)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="no CPU decoder"):
        gdsckpt.save(_state(), path, codec="ans", portable=True)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["a.gdsckpt"]


@pytest.mark.parametrize("how", ["argument", "config", "environment"])
def test_portable_save_writes_a_file_any_machine_reads(tmp_path: Path, how: str, h: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.gdsckpt"
    state = _state()
    if how == "argument":
        report = gdsckpt.save(state, path, portable=True)
    elif how == "config":
        report = gdsckpt.save(state, path, config=gdsckpt.Config(portable=True))
    else:
        monkeypatch.setenv("GDSCKPT_PORTABLE", "1")
        report = gdsckpt.save(state, path)
    info = gdsckpt.inspect(path)
    assert info.portable and not info.gpu_only and report.engine == "cpu"
    h.assert_same(state, gdsckpt.load(path))


def test_portable_false_argument_overrides_the_environment(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The argument wins over ``GDSCKPT_PORTABLE``: with portable=False the GPU-only codec is not
    refused for being GPU-only (on a host without nvCOMP it is refused as unavailable instead)."""
    monkeypatch.setenv("GDSCKPT_PORTABLE", "1")
    with pytest.raises(gdsckpt.CodecUnavailableError):
        gdsckpt.save(_state(), tmp_path / "x.gdsckpt", codec="ans", portable=False,
                     config=gdsckpt.Config(engine="cpu"))


def test_save_async_takes_portable(tmp_path: Path, h: Any) -> None:
    with pytest.raises(ValueError, match="no CPU decoder"):
        gdsckpt.save_async(_state(), tmp_path / "x.gdsckpt", codec="ans", portable=True).wait(timeout=60)
    handle = gdsckpt.save_async(_state(), tmp_path / "y.gdsckpt", portable=True)
    handle.wait(timeout=60)
    assert gdsckpt.inspect(tmp_path / "y.gdsckpt").portable


def test_manager_with_a_portable_config(tmp_path: Path) -> None:
    manager = gdsckpt.CheckpointManager(tmp_path / "run", config=gdsckpt.Config(portable=True))
    with pytest.raises(ValueError, match="no CPU decoder"):
        manager.save(1, _state(), codec="ans")
    manager.save(2, _state())
    assert manager.latest_step() == 2 and gdsckpt.inspect(manager.path(2)).portable


def test_dcp_writer_takes_portable_as_an_option(tmp_path: Path) -> None:
    from torch.distributed import checkpoint as dcp

    from gdsckpt.dcp import GdsStorageWriter

    with pytest.raises(ValueError, match="no CPU decoder"):  # at construction, before any rank writes
        GdsStorageWriter(tmp_path / "e", codec="ans", portable=True)
    writer = GdsStorageWriter(tmp_path / "d", portable=True)
    assert writer.config.portable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "torch.distributed is disabled ..."
        dcp.save({"w": torch.ones(8)}, storage_writer=writer)
    files = [p for p in (tmp_path / "d").iterdir() if p.suffix == ".gdsckpt"]
    assert files and all(gdsckpt.inspect(p).portable for p in files)


def test_lightning_plugin_takes_portable_per_save_and_from_its_config(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from gdsckpt.lightning import GdsCheckpointIO

    with pytest.raises(ValueError, match="no CPU decoder"):  # at construction
        GdsCheckpointIO(codec="ans", config=gdsckpt.Config(portable=True))
    with pytest.raises(ValueError, match="no CPU decoder"):  # or at the save that asks for it
        GdsCheckpointIO(codec="ans").save_checkpoint({"w": torch.ones(4)}, tmp_path / "a.ckpt",
                                                     storage_options={"portable": True})
    GdsCheckpointIO().save_checkpoint({"w": torch.ones(4)}, tmp_path / "b.ckpt",
                                      storage_options={"portable": True})
    assert gdsckpt.inspect(tmp_path / "b.ckpt").portable


# -- auto weighing the engines -------------------------------------------------------------------

def _pace(gbps: float, ratio: float) -> Any:
    from gdsckpt.pipeline.autotune import HostCodecPace

    return HostCodecPace("zstd", gbps, ratio)


def test_auto_takes_the_portable_engine_on_a_disk_that_holds_both_back() -> None:
    """2 GB/s storage, ANS 1.342 against zstd 1.328 (the GPU host's measured ratios), 16 threads
    of 0.3 GB/s: both engines are held by the disk, the portable file is 1% slower: CPU."""
    from gdsckpt.pipeline.autotune import choose_engine

    chosen, figures = choose_engine(2.0, "ans", 1.342, _pace(0.3, 1.328), threads=16)
    assert chosen == "cpu"
    assert figures["predicted_gbps"] == pytest.approx({"gpu:ans": 2.684, "cpu:zstd": 2.656})
    assert figures["cpu_codec_gbps"] == pytest.approx(0.3 * 16 * 0.8) and figures["margin"] == 0.05


def test_auto_keeps_the_gpu_where_only_it_keeps_up_or_its_ratio_is_worth_more() -> None:
    from gdsckpt.pipeline.autotune import choose_engine

    assert choose_engine(40.0, "ans", 1.3, _pace(0.3, 1.3), threads=16)[0] == "gpu"  # a fast NVMe tier
    assert choose_engine(2.0, "ans", 1.55, _pace(1.0, 1.46), threads=16)[0] == "gpu"  # bf16: ANS 6% smaller
    assert choose_engine(2.0, "ans", 1.3, _pace(0.3, 1.3), threads=2)[0] == "gpu"  # 2 threads: 0.48 GB/s


def test_the_cpu_engine_is_not_measured_where_no_pace_could_win() -> None:
    """At ``HOST_CODEC_CEILING_GBPS`` per thread the CPU engine would have to reach 95% of the
    GPU's prediction: a null sink (unbounded storage) or a 100 GB/s tier rule it out before any
    sample; a 2 GB/s disk does not."""
    from gdsckpt.pipeline.autotune import CPU_PARALLEL_EFFICIENCY, HOST_CODEC_CEILING_GBPS, cpu_could_win

    assert not cpu_could_win(float("inf"), "ans", 1.3, threads=16)
    assert not cpu_could_win(100.0, "ans", 1.3, threads=16)
    assert cpu_could_win(2.0, "ans", 1.3, threads=16) and cpu_could_win(2.0, "ans", 1.3, threads=2)
    ceiling = 16 * HOST_CODEC_CEILING_GBPS * CPU_PARALLEL_EFFICIENCY  # the storage at which it tips
    assert cpu_could_win(ceiling / 0.95 / 1.3 * 0.999, "ans", 1.3, threads=16)
    assert not cpu_could_win(ceiling / 0.95 / 1.3 * 1.001, "ans", 1.3, threads=16)


@pytest.mark.parametrize(("cpu_ratio", "expected"), [(1.9, "cpu"), (1.89, "gpu")])
def test_auto_engine_margin_is_five_percent(cpu_ratio: float, expected: str) -> None:
    from gdsckpt.pipeline.autotune import choose_engine

    assert choose_engine(1.0, "ans", 2.0, _pace(10.0, cpu_ratio), threads=1)[0] == expected


def test_host_codec_pace_measures_what_the_cpu_engine_stores(tmp_path: Path) -> None:
    """The sample's ratio is the CPU engine's own on the same arrays (byte planes where they are
    smaller), and its pace is a measured, positive figure."""
    from gdsckpt.pipeline.autotune import measure_host_codec
    from gdsckpt.state.arrays import TorchSource

    g = torch.Generator().manual_seed(1)
    weights = (torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16)
    pace = measure_host_codec([TorchSource(weights, "bfloat16")])
    report = gdsckpt.save({"w": weights}, tmp_path / "w.gdsckpt", codec="zstd",
                          config=gdsckpt.Config(engine="cpu", chunk_bytes=2 << 20))
    assert 0 < pace.gbps_per_thread < 1000 and pace.codec == "zstd"
    assert pace.ratio == pytest.approx(report.logical_bytes / sum(
        c.stored_bytes for c in gdsckpt.inspect(tmp_path / "w.gdsckpt").chunks), rel=0.02)
    never = measure_host_codec([TorchSource(weights, "bfloat16")], byte_planes="never")
    assert never.ratio < pace.ratio  # bf16 weights: planes separate the predictable high bytes


def test_engines_are_weighed_for_full_foreground_saves_only(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta (its XOR sources read on the GPU) and a background save (whose CPU threads would
    compete with training) keep the GPU engine's choice: ``_save_engine`` is told not to weigh."""
    from gdsckpt.api import saving

    seen: list[bool] = []
    original = saving._save_engine

    def recording(*args: Any, weigh_cpu: bool = True, **kwargs: Any) -> Any:
        seen.append(weigh_cpu)
        return original(*args, weigh_cpu=weigh_cpu, **kwargs)

    monkeypatch.setattr(saving, "_save_engine", recording)
    gdsckpt.save(_state(), tmp_path / "a.gdsckpt")
    gdsckpt.save(_state(), tmp_path / "b.gdsckpt", base=tmp_path / "a.gdsckpt")
    flat = flatten(_state())  # as save_async hands over a snapshot of CUDA state: with its devices
    saving.save_flat(flat, tmp_path / "c.gdsckpt", devices=["cpu"] * len(flat.arrays))
    assert seen == [True, False, False]
