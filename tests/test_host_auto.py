"""``codec="auto"`` on host state asks before each save whether the codec threads keep up with the
storage, from the codec's pace its earlier saves measured and the storage's write speed
(``gdsckpt.pipeline.host_auto``). The rule is driven here with recorded paces and given storage
speeds; the saves that follow it are real saves to real files, read back bit-exact."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import gdsckpt
from gdsckpt.io import NullWriter
from gdsckpt.pipeline import autotune
from gdsckpt.pipeline.host_auto import (
    EXPLORE_EVERY,
    HISTORY,
    MEASURED_MIN_BYTES,
    MOVING_WEIGHT,
    HostAutoHistory,
    storage_key,
)

BIG = MEASURED_MIN_BYTES
EFFICIENCY = autotune.CPU_PARALLEL_EFFICIENCY


def _never_probed() -> float:
    raise AssertionError("the storage was probed")


def test_before_any_pace_is_known_a_save_compresses_without_probing() -> None:
    history = HostAutoHistory()
    choice = history.choose("dev:1", BIG, 2, _never_probed)
    assert not choice.as_is and "not measured" in choice.reason and choice.codec_gbps is None
    history.record("dev:1", BIG, None)  # a save that compressed nothing measured no pace
    assert not history.choose("dev:1", BIG, 2, _never_probed).as_is


def test_small_saves_are_neither_weighed_nor_counted() -> None:
    history = HostAutoHistory()
    history.record("dev:1", BIG - 1, 1.0)
    assert history.outcomes("dev:1") is None
    history.record("dev:1", BIG, 0.1)
    choice = history.choose("dev:1", BIG - 1, 2, _never_probed)
    assert not choice.as_is and "not weighed" in choice.reason


@pytest.mark.parametrize("threads", [1, 2, 16])
def test_stored_as_it_is_exactly_when_the_codec_threads_are_slower_than_the_storage(threads: int) -> None:
    history = HostAutoHistory()
    history.record("dev:1", BIG, 0.5)
    codec = threads * 0.5 * EFFICIENCY
    history.record("dev:1", BIG, None)  # a second save (stored as it is): the schedule is not at a retry
    keeps_up = history.choose("dev:1", BIG, threads, lambda: codec)
    assert not keeps_up.as_is and "keep up" in keeps_up.reason
    assert keeps_up.codec_gbps == pytest.approx(codec) and keeps_up.storage_gbps == pytest.approx(codec)
    held_back = history.choose("dev:1", BIG, threads, lambda: codec * 1.01)
    assert held_back.as_is and "hold back" in held_back.reason


def test_a_storage_faster_than_the_codec_is_retried_compressed_every_few_saves() -> None:
    history = HostAutoHistory()
    ways = []
    for _ in range(3 * EXPLORE_EVERY):
        choice = history.choose("dev:1", BIG, 2, lambda: 100.0)
        ways.append(choice.as_is)
        history.record("dev:1", BIG, None if choice.as_is else 0.5)
    assert ways[0] is False  # the first save measures the pace
    assert ways.count(False) == 1 + 2  # then one compressed retry per EXPLORE_EVERY saves
    assert ways[EXPLORE_EVERY] is False and ways[2 * EXPLORE_EVERY] is False


def test_the_pace_is_a_moving_average_per_storage() -> None:
    history = HostAutoHistory()
    history.record("dev:1", BIG, 1.0)
    for _ in range(6):
        history.record("dev:1", BIG, 0.1)  # the state started to compress more slowly
    known = history.outcomes("dev:1")
    assert known is not None and known.saves == 7 and known.gbps_per_thread == pytest.approx(0.1 + 0.9 * MOVING_WEIGHT ** 6)
    assert history.outcomes("dev:2") is None


def test_a_later_process_starts_from_the_pace_an_earlier_one_measured() -> None:
    earlier = HostAutoHistory()
    earlier.record("dev:1", BIG, 0.5, threads=2)
    later = HostAutoHistory()  # a new process on the same machine (the same cache)
    choice = later.choose("dev:1", BIG, 2, lambda: 100.0)
    assert choice.as_is and choice.codec_gbps == pytest.approx(2 * 0.5 * EFFICIENCY)
    assert not later.choose("dev:1", BIG, 16, lambda: 100.0).as_is  # measured on 2 threads, not 16
    assert not later.choose("dev:2", BIG, 2, lambda: 100.0).as_is  # nor on another storage
    earlier.record("dev:3", BIG, 0.5)  # no thread count given: nothing cached
    assert not HostAutoHistory().choose("dev:3", BIG, 2, lambda: 100.0).as_is


def test_storage_keys(tmp_path: Path) -> None:
    assert storage_key(tmp_path / "x.gdsckpt") == (f"dev:{os.stat(tmp_path).st_dev}", tmp_path)
    assert storage_key(str(tmp_path / "x.gdsckpt")) == storage_key(tmp_path / "y.gdsckpt")
    assert storage_key("s3://bucket/a/b.gdsckpt") is None
    assert storage_key(tmp_path / "missing-dir" / "x.gdsckpt") is None
    assert storage_key(NullWriter()) is None


def _big_state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    count = BIG // 4 // 4  # four float32 arrays: exactly MEASURED_MIN_BYTES, one chunk each
    state = {f"w{i}": torch.randn(count, generator=generator) * 0.02 for i in range(4)}
    state["w0"][:3] = torch.tensor([float("nan"), -0.0, float("inf")])
    return state


def _bits_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert got[key].view(torch.int32).equal(tensor.view(torch.int32)), key


def test_real_saves_measure_the_pace_then_follow_the_storage_speed(tmp_path: Path) -> None:
    state = _big_state()
    key = f"dev:{os.stat(tmp_path).st_dev}"
    first = gdsckpt.save(state, tmp_path / "a.gdsckpt", config=gdsckpt.Config(storage_gbps=1e6))
    assert first.auto["stored"] == "compressed" and first.auto["chose"] == "zstd" and first.codec == "zstd"
    assert "storage_key" not in first.auto and "codec_gbps" not in first.auto
    known = HISTORY.outcomes(key)
    assert known is not None and known.saves == 1
    assert (known.gbps_per_thread is not None) == (first.auto["stored_as_is"] < first.chunks)
    HISTORY.record(key, BIG, 0.5)  # whatever the first save met, a pace is known now

    fast = gdsckpt.save(state, tmp_path / "b.gdsckpt", config=gdsckpt.Config(storage_gbps=1e6, codec_threads=2))
    assert fast.auto["stored"] == "as it is" and fast.auto["chose"] == "none" and fast.codec == "none"
    assert fast.chains == {"none/1": fast.chunks} and fast.auto["stored_as_is"] == fast.chunks
    assert fast.auto["storage_gbps"] == 1e6 and fast.auto["codec_gbps"] < 1e6
    assert "hold back" in fast.auto["stored_reason"] and fast.ratio < 1.0  # the state, plus the index
    _bits_equal(gdsckpt.load(tmp_path / "b.gdsckpt"), state)

    slow = gdsckpt.save(state, tmp_path / "c.gdsckpt", config=gdsckpt.Config(storage_gbps=1e-6))
    assert slow.auto["stored"] == "compressed" and slow.codec == "zstd" and "keep up" in slow.auto["stored_reason"]
    # (which chunks the adaptive engine then compresses depends on the writer's timing)
    _bits_equal(gdsckpt.load(tmp_path / "c.gdsckpt"), state)
    known = HISTORY.outcomes(key)
    assert known is not None and known.saves == 4


def test_the_storage_speed_is_probed_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    probes: list[Path] = []
    monkeypatch.setattr(autotune, "measure_storage_gbps", lambda d, n=None, timeout=None: probes.append(d) or 1e6)
    state = _big_state()
    key = f"dev:{os.stat(tmp_path).st_dev}"
    HISTORY.record(key, BIG, 0.5)
    HISTORY.record(key, BIG, None)
    for name in ("a", "b"):
        report = gdsckpt.save(state, tmp_path / f"{name}.gdsckpt")
        assert report.auto["stored"] == "as it is" and report.auto["storage_gbps"] == 1e6
    assert probes == [tmp_path]


def test_a_named_codec_deltas_objects_and_background_saves_are_not_weighed(tmp_path: Path) -> None:
    state = _big_state()
    key = f"dev:{os.stat(tmp_path).st_dev}"
    HISTORY.record(key, BIG, 1e-9)
    HISTORY.record(key, BIG, None)
    before = HISTORY.outcomes(key)
    fast = gdsckpt.Config(storage_gbps=1e6)

    named = gdsckpt.save(state, tmp_path / "named.gdsckpt", codec="zstd", config=fast)
    assert named.auto == {} and named.chains == {"byteplanes/1+zstd/1": named.chunks}

    base = tmp_path / "base.gdsckpt"
    gdsckpt.save(state, base, codec="zstd", config=fast)
    state["w1"][:10] += 1.0
    delta = gdsckpt.save(state, tmp_path / "delta.gdsckpt", base=base, config=fast)
    assert "stored" not in delta.auto and delta.ratio > 5  # compressed, as every delta

    sink = gdsckpt.save(state, NullWriter(), config=fast)
    assert "stored" not in sink.auto and sink.auto["chose"] == "zstd"

    handle = gdsckpt.save_async(state, tmp_path / "async.gdsckpt", config=fast)
    report = handle.wait(timeout=120)
    assert "stored" not in report.auto and report.auto.get("chose") == "zstd"
    _bits_equal(gdsckpt.load(tmp_path / "async.gdsckpt"), state)
    assert HISTORY.outcomes(key) == before  # none of them was weighed or counted
