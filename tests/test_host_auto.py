"""``codec="auto"`` on host state learns, per storage, whether its saves run faster compressed or
stored as they are (``gdsckpt.pipeline.host_auto``). The rule is driven here with recorded
outcomes; the saves that follow it are real saves to real files, read back bit-exact."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import gdsckpt
from gdsckpt.io import NullWriter
from gdsckpt.pipeline.host_auto import (
    EXPLORE_EVERY,
    HISTORY,
    MEASURED_MIN_BYTES,
    HostAutoHistory,
    storage_key,
)

BIG = MEASURED_MIN_BYTES


def _record(history: HostAutoHistory, key: str, *, as_is: bool, gbps: float, stored_as_is: int = 0) -> None:
    history.record(key, as_is=as_is, logical_bytes=BIG, seconds=BIG / gbps / 1e9, stored_as_is=stored_as_is)


def test_the_first_save_compresses_and_one_that_kept_up_keeps_compressing() -> None:
    history = HostAutoHistory()
    first = history.choose("dev:1", BIG)
    assert not first.as_is and first.compressed_gbps is None
    _record(history, "dev:1", as_is=False, gbps=1.0, stored_as_is=0)
    for _ in range(3 * EXPLORE_EVERY):  # the codec threads kept up: nothing else is ever tried
        choice = history.choose("dev:1", BIG)
        assert not choice.as_is and "kept up" in choice.reason
        _record(history, "dev:1", as_is=False, gbps=1.0, stored_as_is=0)


def test_a_save_that_left_the_storage_waiting_is_followed_by_one_stored_as_it_is() -> None:
    history = HostAutoHistory()
    _record(history, "dev:1", as_is=False, gbps=1.0, stored_as_is=3)
    choice = history.choose("dev:1", BIG)
    assert choice.as_is and choice.explore and choice.compressed_gbps == pytest.approx(1.0)
    assert not history.choose("dev:2", BIG).as_is  # another storage knows nothing yet
    assert not history.choose("dev:1", BIG - 1).as_is  # too small to measure: not the one to try it


@pytest.mark.parametrize("as_is_gbps, expect_as_is", [(1.5, True), (0.5, False)])
def test_the_faster_way_wins_and_the_other_is_tried_every_few_saves(as_is_gbps: float, expect_as_is: bool) -> None:
    history = HostAutoHistory()
    _record(history, "dev:1", as_is=False, gbps=1.0, stored_as_is=3)
    _record(history, "dev:1", as_is=True, gbps=as_is_gbps)
    choices = []
    for _ in range(2 * EXPLORE_EVERY):
        choice = history.choose("dev:1", BIG)
        choices.append(choice.as_is)
        # the same speeds again whichever way this save went: only the schedule moves
        _record(history, "dev:1", as_is=choice.as_is, gbps=as_is_gbps if choice.as_is else 1.0, stored_as_is=3)
    assert choices.count(not expect_as_is) == 2  # one try of the slower way per EXPLORE_EVERY saves
    assert choices.count(expect_as_is) == 2 * EXPLORE_EVERY - 2
    # a small save follows the faster way and never explores
    assert all(history.choose("dev:1", BIG - 1).as_is == expect_as_is for _ in range(EXPLORE_EVERY))


def test_the_moving_average_follows_a_storage_that_changed() -> None:
    history = HostAutoHistory()
    _record(history, "dev:1", as_is=False, gbps=1.0, stored_as_is=1)
    _record(history, "dev:1", as_is=True, gbps=2.0)
    assert history.choose("dev:1", BIG - 1).as_is
    for _ in range(4):  # uncompressed saves got slow (a slower disk, a state that compresses well)
        _record(history, "dev:1", as_is=True, gbps=0.2)
    known = history.outcomes("dev:1")
    assert known is not None and known.as_is_gbps is not None and known.as_is_gbps < 1.0
    assert not history.choose("dev:1", BIG - 1).as_is


def test_small_and_unkeyed_saves_are_not_remembered() -> None:
    history = HostAutoHistory()
    history.record("dev:1", as_is=False, logical_bytes=BIG - 1, seconds=0.01, stored_as_is=5)
    history.record(None, as_is=False, logical_bytes=BIG, seconds=0.01, stored_as_is=5)
    assert history.outcomes("dev:1") is None
    assert not history.choose(None, BIG).as_is


def test_storage_keys(tmp_path: Path) -> None:
    assert storage_key(tmp_path / "x.gdsckpt") == f"dev:{os.stat(tmp_path).st_dev}"
    assert storage_key(str(tmp_path / "x.gdsckpt")) == storage_key(tmp_path / "y.gdsckpt")
    assert storage_key("s3://bucket/a/b.gdsckpt") == "s3://bucket".join(["url:", ""])
    assert storage_key("s3://bucket/c.gdsckpt") == storage_key("s3://bucket/a/b.gdsckpt")
    assert storage_key(tmp_path / "missing-dir" / "x.gdsckpt") is None
    assert storage_key(NullWriter()) is None


def _big_state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    count = BIG // 4 // 4  # four 4-byte arrays: exactly MEASURED_MIN_BYTES, one chunk each
    state = {f"w{i}": torch.randn(count, generator=generator) * 0.02 for i in range(4)}
    state["w0"][:3] = torch.tensor([float("nan"), -0.0, float("inf")])
    return state


def _bits_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert got[key].view(torch.int32).equal(tensor.view(torch.int32)), key


def test_real_saves_follow_the_history_and_record_what_they_measured(tmp_path: Path) -> None:
    state = _big_state()
    key = storage_key(tmp_path / "a.gdsckpt")
    first = gdsckpt.save(state, tmp_path / "a.gdsckpt")
    assert first.auto["stored"] == "compressed" and first.auto["chose"] == "zstd"
    assert first.codec == "zstd" and "history_gbps" not in first.auto
    known = HISTORY.outcomes(key)
    assert known is not None and known.saves == 1 and known.compressed_gbps is not None
    assert known.as_is_gbps is None and known.storage_waited == (first.auto["stored_as_is"] > 0)

    # Whatever the first save met, a history in which the storage waited leads to a save
    # stored as it is: every chunk none/1, the file as large as the state, bit-exact.
    HISTORY.clear()
    _record(HISTORY, key, as_is=False, gbps=1.0, stored_as_is=2)
    second = gdsckpt.save(state, tmp_path / "b.gdsckpt")
    assert second.auto["stored"] == "as it is" and second.auto["chose"] == "none" and second.codec == "none"
    assert second.chains == {"none/1": second.chunks} and second.auto["stored_as_is"] == second.chunks
    assert second.auto["history_gbps"] == {"compressed": pytest.approx(1.0), "as it is": None}
    assert "waiting" in second.auto["stored_reason"]
    _bits_equal(gdsckpt.load(tmp_path / "b.gdsckpt"), state)
    known = HISTORY.outcomes(key)
    assert known is not None and known.saves == 2 and known.as_is_gbps is not None

    # Uncompressed measured faster: the next saves store as they are, until the schedule's try
    HISTORY.clear()
    _record(HISTORY, key, as_is=False, gbps=0.001, stored_as_is=2)
    _record(HISTORY, key, as_is=True, gbps=1000.0)
    third = gdsckpt.save(state, tmp_path / "c.gdsckpt")
    assert third.auto["stored"] == "as it is" and "faster uncompressed" in third.auto["stored_reason"]
    _bits_equal(gdsckpt.load(tmp_path / "c.gdsckpt"), state)


def test_a_named_codec_deltas_and_background_saves_ignore_the_history(tmp_path: Path) -> None:
    state = _big_state()
    key = storage_key(tmp_path / "a.gdsckpt")
    _record(HISTORY, key, as_is=False, gbps=0.001, stored_as_is=2)
    _record(HISTORY, key, as_is=True, gbps=1000.0)
    before = HISTORY.outcomes(key)

    named = gdsckpt.save(state, tmp_path / "named.gdsckpt", codec="zstd")
    assert named.auto == {} and named.chains == {"byteplanes/1+zstd/1": named.chunks}

    base = tmp_path / "base.gdsckpt"
    gdsckpt.save(state, base, codec="zstd")
    state["w1"][:10] += 1.0
    delta = gdsckpt.save(state, tmp_path / "delta.gdsckpt", base=base)
    assert "stored" not in delta.auto and delta.ratio > 5  # compressed, as every delta

    handle = gdsckpt.save_async(state, tmp_path / "async.gdsckpt")
    report = handle.wait(timeout=120)
    assert "stored" not in report.auto and report.auto.get("chose") == "zstd"
    _bits_equal(gdsckpt.load(tmp_path / "async.gdsckpt"), state)
    assert HISTORY.outcomes(key) == before  # none of them was recorded
