"""The command line, run as ``python -m gdsckpt`` in a subprocess: exit codes and output."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gdsckpt


@pytest.fixture
def saved(ckpt_path: Path, h: Any) -> Path:
    g = torch.Generator().manual_seed(0)
    state = {"model": {"embed.weight": torch.randn(3000, generator=g), "head.bias": torch.randn(10, generator=g)},
             "tied": None, "step": 5}
    state["tied"] = state["model"]["embed.weight"]
    gdsckpt.save(state, ckpt_path, config=h.small_config())
    return ckpt_path


def test_demo_runs_and_restores_bit_exact(tmp_path: Path, h: Any) -> None:
    result = h.run_cli("demo", "--width", "64", "--depth", "1", "--dir", str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bit-exact: yes" in result.stdout
    assert "torch.save" in result.stdout and "gdsckpt" in result.stdout
    # the conditions both sides were measured under, the same for both
    assert "median of 3 round(s)" in result.stdout and "saves durable (fsync" in result.stdout
    assert "loads cold" in result.stdout or "loads warm" in result.stdout
    # one plain verdict per direction, whichever side won, saying it is a median
    for what, baseline in (("save", "torch.save"), ("load", "torch.load")):
        assert (f"{what}: gdsckpt faster" in result.stdout) != (f"{what}: {baseline} was faster here" in result.stdout)
    assert result.stdout.count("median of 3 rounds") == 2
    assert list(tmp_path.iterdir()) == [], "the demo cleans up its files"


def test_demo_help_states_the_default_state_size() -> None:
    """``demo --help`` says how much state the defaults save: model + AdamW's two moments, fp32."""
    import re

    from gdsckpt.cli.main import build_parser
    from gdsckpt.tools.demo import VOCAB, TinyGPT

    demo = next(action for action in build_parser()._actions if action.dest == "command").choices["demo"]
    width_help = next(action for action in demo._actions if action.dest == "width")
    stated = re.search(r"default (\d+): about (\d+) MB.*--depth (\d+)", width_help.help or "")
    assert stated, width_help.help
    width, megabytes, depth = (int(g) for g in stated.groups())
    assert (width, depth) == (width_help.default, next(a for a in demo._actions if a.dest == "depth").default)
    parameters = sum(p.numel() for p in TinyGPT(vocab=VOCAB, width=width, depth=depth).parameters())
    assert abs(parameters * 4 * 3 / 1e6 - megabytes) < 0.05 * megabytes


def test_demo_verdicts_name_the_winner_and_why() -> None:
    from gdsckpt.demo import verdict

    assert verdict("save", 300.0, 100.0, 1.3, "cuda", 3) == "save: gdsckpt faster, 3.0x torch.save (median of 3 rounds)"
    lost = verdict("load", 500.0, 900.0, 1.25, "cpu", 5)
    assert lost.startswith("load: torch.load was faster here (900 against 500 MB/s, median of 5 rounds)")
    assert "decompressing" in lost
    assert "fixed costs" in verdict("save", 10.0, 20.0, 1.0, "cpu")


def test_demo_measures_both_sides_every_round(tmp_path: Path) -> None:
    """Each side is timed once per round, on the same terms (the figures are medians of those)."""
    from gdsckpt.demo import run_demo

    figures = run_demo(width=32, depth=1, directory=str(tmp_path), device="cpu", rounds=3)
    assert figures["bit_exact"] and figures["rounds"] == 3
    assert {what: len(seconds) for what, seconds in figures["seconds"].items()} == {
        "save": 3, "torch_save": 3, "load": 3, "torch_load": 3}
    assert figures["cold_loads"] is hasattr(os, "posix_fadvise")
    assert list(tmp_path.iterdir()) == []


def test_demo_saves_are_durable_whatever_the_environment_says(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo says both sides' saves are durable (fsync inside the timing) and always fsyncs
    torch.save's file; gdsckpt's save followed ``GDSCKPT_FSYNC``, so with it off the comparison
    timed a save without fsync against one with."""
    from gdsckpt import api
    from gdsckpt.demo import run_demo

    monkeypatch.setenv("GDSCKPT_FSYNC", "false")
    saving, synced = [False], []
    real_fsync, real_save = os.fsync, api.save

    def recording(fd: int) -> None:
        with contextlib.suppress(OSError):
            synced.append((saving[0], os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def save(*args: Any, **kwargs: Any) -> Any:
        saving[0] = True
        try:
            return real_save(*args, **kwargs)
        finally:
            saving[0] = False

    monkeypatch.setattr(os, "fsync", recording)
    monkeypatch.setattr(api, "save", save)
    assert run_demo(width=32, depth=1, directory=str(tmp_path), device="cpu", rounds=1)["bit_exact"]
    # inside the save (the cold load's eviction fsyncs the file too, outside any timing)
    assert any(during and "demo.gdsckpt" in path for during, path in synced), synced


def test_inspect_prints_every_array(saved: Path, h: Any) -> None:
    result = h.run_cli("inspect", str(saved))
    assert result.returncode == 0, result.stderr
    assert "format 1.0" in result.stdout
    for key in ("model/embed.weight", "model/head.bias", "tied"):
        assert key in result.stdout
    assert "alias of model/embed.weight" in result.stdout
    assert "2 arrays (+1 alias of them)" in result.stdout  # as the group totals count them


def test_inspect_says_whether_a_file_is_portable(saved: Path, tmp_path: Path, h: Any) -> None:
    """A file whose chunks all decode on a CPU says so; one with a GPU-only bitstream names it and
    the command that writes a portable copy, in the text and in ``--json``."""
    assert gdsckpt.inspect(saved).portable
    text = h.run_cli("inspect", str(saved))
    assert text.returncode == 0 and "portable: every chunk decodes without a GPU" in text.stdout
    assert json.loads(h.run_cli("inspect", "--json", str(saved)).stdout)["portable"] is True
    gpu_only = tmp_path / "gpu.gdsckpt"
    gdsckpt.save({"w": np.arange(3000, dtype=np.float32)}, gpu_only, codec="zstd", config=h.small_config())

    def edit(doc: dict[str, Any]) -> None:
        doc["chains"] = [[{"name": "nvcomp.ans/1"}] if chain[-1]["name"] == "zstd/1" else chain
                         for chain in doc["chains"]]

    h.rewrite_index(gpu_only, edit)
    info = gdsckpt.inspect(gpu_only)
    assert not info.portable and info.gpu_only == ("nvcomp.ans/1",)
    text = h.run_cli("inspect", str(gpu_only))
    assert text.returncode == 0
    assert "not portable: nvcomp.ans/1" in text.stdout and "gdsckpt convert" in text.stdout
    doc = json.loads(h.run_cli("inspect", "--json", str(gpu_only)).stdout)
    assert doc["portable"] is False and doc["gpu_only"] == ["nvcomp.ans/1"]


def test_inspect_json_is_valid_and_complete(saved: Path, h: Any) -> None:
    result = h.run_cli("inspect", "--json", str(saved))
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    info = gdsckpt.inspect(saved)
    assert doc["path"] == str(saved)
    assert doc["format_version"] == [1, 0]
    assert doc["file_bytes"] == saved.stat().st_size == info.file_bytes
    assert doc["logical_bytes"] == info.logical_bytes
    assert doc["codecs"] == info.codecs
    assert [t["key"] for t in doc["tensors"]] == ["model/embed.weight", "model/head.bias", "tied"]
    embed = doc["tensors"][0]
    assert embed["dtype"] == "float32" and embed["shape"] == [3000] and embed["nbytes"] == 12000
    assert doc["tensors"][2]["alias_of"] == "model/embed.weight"


def test_verify_good_file_exits_zero(saved: Path, h: Any) -> None:
    result = h.run_cli("verify", str(saved))
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout
    assert f"{len(h.read_index(saved).chunks)} chunks" in result.stdout


def test_verify_corrupt_file_exits_one_naming_tensor_and_chunk(saved: Path, h: Any) -> None:
    index = h.read_index(saved)
    chunk_number = index.tensors[0].segments[1].chunk
    chunk = index.chunks[chunk_number]
    data = bytearray(saved.read_bytes())
    data[chunk.offset + chunk.stored // 3] ^= 0x40
    saved.write_bytes(bytes(data))
    result = h.run_cli("verify", str(saved))
    assert result.returncode == 1
    assert "model/embed.weight" in result.stderr and f"chunk {chunk_number}" in result.stderr
    assert "Traceback" not in result.stderr
    assert "OK" not in result.stdout


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_missing_or_foreign_file_exits_one(command: str, tmp_path: Path, h: Any) -> None:
    missing = h.run_cli(command, str(tmp_path / "absent.gdsckpt"))
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"\x00" * 9000)
    result = h.run_cli(command, str(foreign))
    assert result.returncode == 1 and "not a gdsckpt checkpoint" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [
    [],
    ["frobnicate"],
    ["inspect"],
    ["verify"],
    ["verify", "a", "b"],
    ["demo", "--width", "wide"],
    ["inspect", "--bogus", "x"],
    ["bench", "--target", ".", "--threads", "100000"],
    ["plan", "--params", "7B", "--interval", "9" * 400],
])
def test_bad_arguments_exit_two(args: list[str], h: Any) -> None:
    result = h.run_cli(*args)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and ": error: " in result.stderr and "--help' for usage" not in result.stderr
    assert result.stderr.rstrip().endswith("--help')")


def test_help_exits_zero(h: Any) -> None:
    result = h.run_cli("--help")
    assert result.returncode == 0
    for command in ("demo", "inspect", "verify"):
        assert command in result.stdout


def test_inspect_totals_by_group(tmp_path: Path, h: Any) -> None:
    g = torch.Generator().manual_seed(1)
    weights = {"w": torch.randn(4000, generator=g).to(torch.bfloat16), "b": torch.zeros(512)}
    state = {"model": weights, "optimizer": {"state": {0: {"exp_avg": torch.randn(4000, generator=g) * 1e-3,
                                                          "exp_avg_sq": torch.rand(4000, generator=g) * 1e-6}}},
             "step": 3}
    path = tmp_path / "g.gdsckpt"
    gdsckpt.save(state, path, config=h.small_config())
    result = h.run_cli("inspect", "--json", str(path))
    assert result.returncode == 0, result.stderr
    groups = json.loads(result.stdout)["groups"]
    assert set(groups) == {"model", "optimizer/exp_avg", "optimizer/exp_avg_sq"}
    info = {t.key: t for t in gdsckpt.inspect(path).tensors}
    model = groups["model"]
    assert model["arrays"] == 2 and model["logical_bytes"] == 4000 * 2 + 512 * 4
    assert model["stored_bytes"] == info["model/w"].stored_bytes + info["model/b"].stored_bytes
    assert model["ratio"] == pytest.approx(model["logical_bytes"] / model["stored_bytes"])
    text = h.run_cli("inspect", str(path)).stdout
    assert "optimizer/exp_avg_sq" in text and "total" in text


def test_quiet_and_config_are_global_options(saved: Path, tmp_path: Path, h: Any) -> None:
    result = h.run_cli("--quiet", "verify", str(saved))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    missing = h.run_cli("--config", str(tmp_path / "nope.toml"), "verify", str(saved))
    assert missing.returncode == 2 and "--config" in missing.stderr


def test_progress_callbacks_reach_the_total(tmp_path: Path, h: Any) -> None:
    state = {"a": torch.randn(50_000), "b": [torch.ones(100), torch.zeros(3000, dtype=torch.bfloat16)]}
    logical = 50_000 * 4 + 100 * 4 + 3000 * 2
    path = tmp_path / "p.gdsckpt"
    for name, call in (("save", lambda p: gdsckpt.save(state, path, config=h.small_config(), progress=p)),
                       ("load", lambda p: gdsckpt.load(path, progress=p)),
                       ("verify", lambda p: gdsckpt.verify(path, progress=p))):
        seen: list[tuple[int, int]] = []
        call(lambda done, total, seen=seen: seen.append((done, total)))
        assert len(seen) > 1, name
        assert all(total == logical for _done, total in seen), name
        dones = [done for done, _total in seen]
        assert dones == sorted(dones) and dones[-1] == logical, name


def test_bench_stops_when_its_time_budget_is_spent(tmp_path: Path, h: Any) -> None:
    """Once ``--max-seconds`` was spent, every remaining round of ``--repeats`` still ran its
    bookkeeping: 100,000 repeats took over an hour for a 1 s budget."""
    out = tmp_path / "out"
    result = h.run_cli("-q", "bench", "--target", str(tmp_path), "--size", "1MiB", "--codecs", "zstd",
                       "--chunk-sizes", "1MiB", "--threads", "1", "--baselines", "none", "--out", str(out),
                       "--repeats", "100000", "--max-seconds", "1", timeout=90)
    assert result.returncode == 0, result.stderr
    assert "of 100000 repeats: the time budget" in result.stdout  # the table says how few ran


def test_bench_refuses_a_directory_as_preset_out_before_measuring(tmp_path: Path, h: Any) -> None:
    result = h.run_cli("bench", "--target", str(tmp_path), "--size", "1MiB", "--recommend",
                       "--preset-out", str(tmp_path), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "--preset-out" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_rebase_keeps_an_existing_output_unless_told(tmp_path: Path, h: Any) -> None:
    """``rebase DELTA -o model.pt`` replaced an existing torch.save file without a word."""
    state = {"w": torch.arange(100.0)}
    gdsckpt.save(state, tmp_path / "a.gdsckpt")
    gdsckpt.save({"w": state["w"] + 1}, tmp_path / "b.gdsckpt", base=tmp_path / "a.gdsckpt")
    other = tmp_path / "model.pt"
    torch.save({"x": torch.ones(3)}, other)
    before = other.read_bytes()
    result = h.run_cli("rebase", str(tmp_path / "b.gdsckpt"), "-o", str(other))
    assert result.returncode == 1 and "--overwrite" in result.stderr, result.stderr
    assert other.read_bytes() == before
    result = h.run_cli("rebase", str(tmp_path / "b.gdsckpt"), "-o", str(other), "--overwrite")
    assert result.returncode == 0, result.stderr
    assert "ForeignExtensionWarning" in result.stderr or ".pt" in result.stderr
    assert torch.equal(gdsckpt.load(other)["w"], state["w"] + 1)


def test_inspect_escapes_keys_that_would_forge_lines(tmp_path: Path, h: Any) -> None:
    path = tmp_path / "keys.gdsckpt"
    gdsckpt.save({"a\nportable: every chunk decodes": torch.ones(3), "\x1b[31mred": torch.zeros(2)}, path)
    result = h.run_cli("inspect", str(path))
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout
    assert "a\\nportable" in result.stdout and "\\x1b[31mred" in result.stdout
    assert sum(line.startswith("portable:") for line in result.stdout.splitlines()) <= 1


def test_plan_from_a_delta_checkpoint_is_refused(tmp_path: Path, h: Any) -> None:
    """Its chunks hold XORs with the base: an unchanged state planned at "ratio 15420"."""
    state = {"w": torch.randn(10_000, generator=torch.Generator().manual_seed(0))}
    gdsckpt.save(state, tmp_path / "a.gdsckpt")
    gdsckpt.save(state, tmp_path / "b.gdsckpt", base=tmp_path / "a.gdsckpt")
    result = h.run_cli("plan", "--from", str(tmp_path / "b.gdsckpt"))
    assert result.returncode == 1 and "delta checkpoint" in result.stderr and "rebase" in result.stderr
    assert h.run_cli("plan", "--from", str(tmp_path / "a.gdsckpt")).returncode == 0


def test_convert_to_a_path_ending_in_a_slash_writes_nothing(tmp_path: Path, h: Any) -> None:
    source = tmp_path / "a.pt"
    torch.save({"w": torch.ones(3)}, source)
    result = h.run_cli("convert", str(source), str(tmp_path / "out.gdsckpt") + "/")
    assert result.returncode == 1 and "not a directory" in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]


def test_a_delta_opened_through_a_symlink_elsewhere_finds_its_base(tmp_path: Path, h: Any) -> None:
    """The base's relative path was resolved beside the link: "missing", or with an unrelated
    file of the base's name there, "changed"."""
    (tmp_path / "run").mkdir()
    (tmp_path / "links").mkdir()
    state = {"w": torch.arange(64.0)}
    gdsckpt.save(state, tmp_path / "run" / "a.gdsckpt")
    gdsckpt.save({"w": state["w"] + 1}, tmp_path / "run" / "b.gdsckpt", base=tmp_path / "run" / "a.gdsckpt")
    gdsckpt.save({"w": torch.zeros(64)}, tmp_path / "links" / "a.gdsckpt")  # a decoy beside the link
    (tmp_path / "links" / "best.gdsckpt").symlink_to(tmp_path / "run" / "b.gdsckpt")
    assert torch.equal(gdsckpt.load(tmp_path / "links" / "best.gdsckpt")["w"], state["w"] + 1)
    assert h.run_cli("verify", str(tmp_path / "links" / "best.gdsckpt")).returncode == 0


def test_demo_refuses_a_cpu_index_before_any_work(h: Any) -> None:
    """``--device cpu:1`` ran the whole demo, then failed inside torch.load with exit 1."""
    result = h.run_cli("demo", "--device", "cpu:1")
    assert result.returncode == 2 and "cpu:1" in result.stderr and "Traceback" not in result.stderr


def test_convert_of_random_bytes_named_pt_says_it_is_no_torch_file(tmp_path: Path, h: Any) -> None:
    """It said the file held "objects other than tensors" (an unsafe pickle), for bytes that are
    no pickle at all."""
    source = tmp_path / "random.pt"
    source.write_bytes(np.random.default_rng(0).bytes(4096))
    result = h.run_cli("convert", str(source), str(tmp_path / "out.gdsckpt"))
    assert result.returncode == 1 and "no torch.save file, or a damaged one" in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["random.pt"]
