"""What ``inspect`` reports of stored bytes: exact per chunk, exact per array and per group where
chunks are not shared, marked as estimates where they are, and no ratio where nothing is stored
(issue 21); ``gdsckpt inspect`` prints them so and ``plan --from`` plans with the same figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import gdsckpt
from gdsckpt.tools.costmodel import group_of, group_sizes

CONFIG = gdsckpt.Config(chunk_bytes=64 << 10, pack_below=16 << 10)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(32 << 10, generator=g).to(torch.bfloat16)},  # 64 KiB: a chunk of its own
        "optimizer": {"state": {0: {"exp_avg": torch.randn(256, generator=g) * 1e-3,  # small: packed
                                    "exp_avg_sq": torch.zeros(256)}}},
        "empty": torch.zeros(0),
    }


def test_chunks_are_reported_exactly_and_arrays_sharing_them_as_estimates(ckpt_path: Path) -> None:
    gdsckpt.save(_state(), ckpt_path, codec="zstd", config=CONFIG)
    info = gdsckpt.inspect(ckpt_path)
    tensors = {t.key: t for t in info.tensors}
    verified = gdsckpt.verify(ckpt_path)
    assert sum(c.stored_bytes for c in info.chunks) == verified.chunk_bytes
    own = next(c for c in info.chunks if c.arrays == (("model/w", 64 << 10),))
    assert tensors["model/w"].stored_bytes == own.stored_bytes and not tensors["model/w"].stored_estimated
    assert tensors["model/w"].ratio == (64 << 10) / own.stored_bytes
    pack = next(c for c in info.chunks if len(c.arrays) == 2)
    assert {key for key, _ in pack.arrays} == {"optimizer/state/0/exp_avg", "optimizer/state/0/exp_avg_sq"}
    for key, _length in pack.arrays:
        assert tensors[key].stored_estimated
    assert tensors["empty"].ratio is None and tensors["empty"].stored_bytes == 0  # no "ratio 0.000"

    # Per group: exact where a group's chunks hold only its arrays.
    groups = info.groups(group_of)
    assert groups["model"].stored_bytes == own.stored_bytes and not groups["model"].estimated
    assert groups["optimizer/exp_avg"].estimated and groups["optimizer/exp_avg_sq"].estimated
    whole = info.groups()  # by top-level key: the optimizer's pack is the optimizer's alone
    assert whole["optimizer"].stored_bytes == pack.stored_bytes and not whole["optimizer"].estimated
    assert whole["empty"].ratio is None


def test_a_lossless_group_sharing_no_chunk_keeps_its_own_ratio(ckpt_path: Path) -> None:
    """Arrays that compress very differently, packed apart (their groups' arrays are large enough
    for chunks of their own), report each their own ratio, not a shared average."""
    g = torch.Generator().manual_seed(4)
    state = {"zeros": torch.zeros(16 << 10), "noise": torch.randint(0, 2**31, (16 << 10,), generator=g,
                                                                       dtype=torch.int32).view(torch.float32)}
    gdsckpt.save(state, ckpt_path, codec="zstd", config=CONFIG)
    groups = gdsckpt.inspect(ckpt_path).groups()
    assert not groups["zeros"].estimated and not groups["noise"].estimated
    assert groups["zeros"].ratio is not None and groups["zeros"].ratio > 50
    assert groups["noise"].ratio is not None and groups["noise"].ratio < 1.1


def test_a_delta_array_never_shows_a_zero_ratio(tmp_path: Path) -> None:
    state = _state()
    gdsckpt.save(state, tmp_path / "base.gdsckpt", config=CONFIG)
    gdsckpt.save(state, tmp_path / "delta.gdsckpt", base=tmp_path / "base.gdsckpt", config=CONFIG)
    info = gdsckpt.inspect(tmp_path / "delta.gdsckpt")
    deltas = [t for t in info.tensors if t.delta]
    assert deltas
    for t in deltas:
        assert t.ratio is None or t.ratio > 1, t


def test_the_command_marks_estimates_and_plan_reads_the_same_groups(ckpt_path: Path, h: Any) -> None:
    gdsckpt.save(_state(), ckpt_path, codec="zstd", config=CONFIG)
    text = h.run_cli("inspect", str(ckpt_path)).stdout
    lines = text.splitlines()
    table = lines[:next(i for i, line in enumerate(lines) if line.split()[:1] == ["group"])]
    rows = {line.split()[0]: line for line in table if line.startswith("  ")}
    assert "~" not in rows["model/w"] and "~" in rows["optimizer/state/0/exp_avg"]
    assert rows["empty"].split()[-2] == "-"  # no stored bytes: no ratio, not 0.000
    assert "0.000" not in text
    assert "~: an estimate" in text
    document = json.loads(h.run_cli("inspect", "--json", str(ckpt_path)).stdout)
    assert document["groups"]["model"]["estimated"] is False
    assert sum(c["stored_bytes"] for c in document["chunks"]) == gdsckpt.verify(ckpt_path).chunk_bytes
    groups = gdsckpt.inspect(ckpt_path).groups(group_of)
    planned = group_sizes(ckpt_path)
    assert {name: g.stored_bytes for name, g in planned.items()} == {name: g.stored_bytes
                                                                      for name, g in groups.items()}
    assert planned["model"].dtype == "bf16"
