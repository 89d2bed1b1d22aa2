"""``codec="auto"`` on the CPU adapts to the storage: a chunk whose codec thread starts while the
writer has nothing queued is stored as it is (the storage waits for compression); while writes
are queued, the writer's measured pace against the codec's measured speed decides (compressed
when the storage stays busy meanwhile or the bytes saved pay for the wait). The decision is
driven here through a writer that reports a fixed backlog and pace (standing for fast or slow
storage); the real writers' reports are checked separately."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt.api.saving import index_template
from gdsckpt.io import MemoryReader, MemoryStore, MemoryWriter, NullWriter, PosixWriter
from gdsckpt.io.base import WritePace
from gdsckpt.pipeline.engine import HostEngine
from gdsckpt.pipeline.load import open_file
from gdsckpt.pipeline.plan import plan_chunks
from gdsckpt.pipeline.save import run_save
from gdsckpt.state import flatten


class ReportingWriter(MemoryWriter):
    """A memory writer that reports a fixed backlog (0: the storage waits) and pace (None: none
    measured)."""

    def __init__(self, store: MemoryStore, backlog: int | None, pace: WritePace | None = None):
        super().__init__(store, "ckpt")
        self.reported = backlog
        self.reported_pace = pace

    def backlog(self) -> int | None:
        return self.reported

    def pace(self) -> WritePace | None:
        return self.reported_pace


def _state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(40_000, generator=generator) * 0.02 for i in range(6)}


def _save(backlog: int | None, adaptive: bool, pace: WritePace | None = None) -> tuple[list[str], HostEngine,
                                                                                      MemoryStore]:
    flat = flatten(_state())
    plans = plan_chunks([(a.source.nbytes, a.source.itemsize, a.source.plane_width) for a in flat.arrays],
                        chunk_bytes=64 << 10, pack_below=16 << 10)
    engine = HostEngine([a.source for a in flat.arrays], codec="zstd", byte_planes="auto", threads=2,
                        adaptive=adaptive)
    store = MemoryStore()
    try:
        result = run_save(plans, engine, ReportingWriter(store, backlog, pace), max_inflight_bytes=1 << 20,
                          index=index_template(flat))
    finally:
        engine.close()
    labels = [result.chains[record.chain].to_json()[-1]["name"] for record in result.chunks]
    return labels, engine, store


def test_storage_whose_writes_cost_nothing_gets_every_chunk_as_it_is() -> None:
    labels, engine, store = _save(backlog=0, adaptive=True, pace=WritePace(0, math.inf))
    assert set(labels) == {"none/1"} and engine.stored_raw == len(labels) > 10
    index = open_file(MemoryReader(store, "ckpt")).index
    assert all(chunk.stored == chunk.raw for chunk in index.chunks)


def test_storage_waiting_for_an_unmeasured_codec_gets_chunks_compressed() -> None:
    """An idle writer (nothing pending) stored every chunk as it is, before anything was measured
    and whatever the bytes saved: 4 MiB of zeros saved with ``auto`` made a 4.2 MB file (zstd: 8.6
    KB) while the report said "compressed". Nothing measured: compressed, as the docs say."""
    labels, engine, _store = _save(backlog=0, adaptive=True)
    assert set(labels) == {"zstd/1"} and engine.stored_raw == 0


def test_waiting_storage_still_gets_chunks_compressed_whose_bytes_saved_pay_for_it(tmp_path: Path) -> None:
    """A real save of zeros to a file with ``auto`` (under the size that is weighed): its writer is
    idle at every chunk, and zeros compress far faster than any disk writes them."""
    report = gdsckpt.save({"zeros": torch.zeros(1 << 20)}, tmp_path / "z.gdsckpt", chunk_bytes=256 << 10)
    assert report.auto["adaptive"] and report.auto["stored_as_is"] == 0, report.auto
    assert (tmp_path / "z.gdsckpt").stat().st_size < (4 << 20) // 16  # stored whole: 4 MiB


@pytest.mark.parametrize("backlog, adaptive", [(3, True), (None, True), (0, False)])
def test_busy_or_unknown_storage_or_a_named_codec_compresses(backlog: int | None, adaptive: bool) -> None:
    labels, engine, _store = _save(backlog=backlog, adaptive=adaptive)
    assert set(labels) == {"zstd/1"} and engine.stored_raw == 0


def test_storage_faster_than_the_codec_gets_chunks_as_they_are_once_the_codec_is_measured() -> None:
    """Writes queued, but the storage drains them in no time at 100 GB/s: after the first chunks
    (compressed: nothing measured yet, one per codec thread at most before a measurement lands)
    every chunk is stored as it is."""
    labels, engine, _store = _save(backlog=2, adaptive=True, pace=WritePace(64 << 10, 100e9))
    compressed = labels.count("zstd/1")
    assert 1 <= compressed <= 4 and labels.count("none/1") == engine.stored_raw == len(labels) - compressed
    assert labels[0] == "zstd/1"


def test_slow_storage_with_writes_pending_gets_every_chunk_compressed() -> None:
    """1 MB/s with 8 MiB pending: draining takes seconds, compressing a chunk milliseconds."""
    labels, engine, _store = _save(backlog=2, adaptive=True, pace=WritePace(8 << 20, 1e6))
    assert set(labels) == {"zstd/1"} and engine.stored_raw == 0


def test_compressed_exactly_while_the_bytes_saved_pay_for_the_wait() -> None:
    """Nothing pending but the writes in progress: a chunk compressed is on storage after
    ``encode + write / ratio``, stored as it is after ``write``, so it is compressed exactly when
    ``write * (1 - 1 / ratio)`` exceeds ``encode``. With a codec measured at 100 MB/s and ratio 2
    the break-even storage speed is 50 MB/s: just above it chunks are stored as they are, just
    below compressed."""
    engine = HostEngine([], codec="zstd", byte_planes="auto", threads=1, adaptive=True)
    try:
        engine._measured(raw_bytes=100 << 20, stored_bytes=50 << 20, seconds=(100 << 20) / 100e6)
        storage = [0.0]
        engine.watch_storage(lambda: 1, lambda: WritePace(0, storage[0]))
        chunk = 4 << 20
        decisions = {}
        for factor in (0.5, 0.99, 1.01, 2.0):
            storage[0] = 50e6 * factor
            decisions[factor] = engine._store_as_is(chunk)
        assert decisions == {0.5: False, 0.99: False, 1.01: True, 2.0: True}
    finally:
        engine.close()


def test_storage_far_beyond_or_below_the_break_even_decides_in_a_real_save() -> None:
    """The same rule with the codec's speed measured live during the save: storage a thousand
    times faster than the break-even measured beforehand gets chunks as they are (after the first
    ones, compressed to measure the codec), a thousand times slower gets them compressed. The
    margins are wide because the live measurement on a shared machine can differ from the
    calibration several-fold."""
    speed, ratio = _codec_pace()
    even = speed * (1 - 1 / ratio)  # storage speed at which the bytes saved just pay
    fast = _save(backlog=1, adaptive=True, pace=WritePace(0, even * 1000))[0]
    slow = _save(backlog=1, adaptive=True, pace=WritePace(0, even / 1000))[0]
    assert fast.count("none/1") >= len(fast) - 4
    assert set(slow) == {"zstd/1"}


def _codec_pace() -> tuple[float, float]:
    """(raw bytes per second, ratio) of the engine's codec on this state's chunks."""
    _labels, engine, _store = _save(backlog=3, adaptive=True)
    measured = engine.codec_pace()
    assert measured is not None and measured[1] > 1.0
    return measured


def test_auto_into_the_null_sink_stores_as_is_and_says_so(tmp_path: Path) -> None:
    state = _state()
    report = gdsckpt.save(state, NullWriter(), chunk_bytes=64 << 10)
    assert report.engine == "cpu" and report.chains == {"none/1": report.chunks}
    assert report.auto == {"chose": "zstd", "adaptive": True, "stored_as_is": report.chunks}
    named = gdsckpt.save(state, NullWriter(), codec="zstd", chunk_bytes=64 << 10)
    assert named.auto == {} and "none/1" not in named.chains and named.ratio > 1.0


def test_files_written_adaptively_load_bit_exact(tmp_path: Path) -> None:
    state = _state()
    path = tmp_path / "x.gdsckpt"
    report = gdsckpt.save(state, path, chunk_bytes=64 << 10)
    assert report.auto["adaptive"] and 0 <= report.auto["stored_as_is"] <= report.chunks
    assert report.chains.get("none/1", 0) >= report.auto["stored_as_is"]
    loaded = gdsckpt.load(path)
    for key, tensor in state.items():
        assert loaded[key].view(torch.int32).equal(tensor.view(torch.int32))


def test_posix_writer_backlog_and_pace_say_only_what_writes_show(tmp_path: Path) -> None:
    buffered = PosixWriter(tmp_path / "a.gdsckpt", o_direct=False)
    try:
        # the page cache absorbs buffered writes to a disk
        assert buffered.backlog() is None and buffered.pace() is None
    finally:
        buffered.abort()
    direct = PosixWriter(tmp_path / "b.gdsckpt", o_direct="auto")
    try:
        assert direct.backlog() == 0  # O_DIRECT, or a filesystem whose pages are the storage
        pace = direct.pace()
        assert pace is not None and pace.pending_bytes == 0 and pace.bytes_per_second is None
        direct.submit_write(0, np.zeros(4096, dtype=np.uint8)).result(timeout=30)
        assert direct.backlog() == 0
        futures = [direct.submit_write(4096 + (i << 20), np.ones(1 << 20, dtype=np.uint8)) for i in range(4)]
        for future in futures:
            future.result(timeout=30)
        pace = direct.pace()
        assert pace is not None and pace.pending_bytes == 0
        assert pace.bytes_per_second is not None and pace.bytes_per_second > 0
    finally:
        direct.abort()


def test_a_delta_is_compressed_even_while_the_storage_waits(tmp_path: Path) -> None:
    state = _state()
    base = tmp_path / "base.gdsckpt"
    gdsckpt.save(state, base, codec="zstd", chunk_bytes=64 << 10)
    state["w0"][:10] += 1.0  # a small change: the XOR with the base is mostly zeros
    path = tmp_path / "delta.gdsckpt"
    report = gdsckpt.save(state, path, base=base, chunk_bytes=64 << 10)
    assert report.delta_tensors == len(state)
    assert report.auto["stored_as_is"] == 0 and report.ratio > 5  # each chunk a few aligned KiB


def test_a_later_array_that_compresses_is_compressed_after_incompressible_ones() -> None:
    """Only compressed chunks measured the codec: after incompressible bytes every chunk was
    stored as it is for the rest of the save, zeros included, on storage slow enough that
    compressing them saves far more write time than it takes. Every ``RESAMPLE_EVERY``-th chunk
    in a row stored as it is now has a sample compressed, and the zeros are compressed."""
    from gdsckpt.pipeline.engine import RESAMPLE_EVERY

    rng = np.random.default_rng(0)
    flat = flatten({"a_random": rng.integers(0, 256, 1 << 20, dtype=np.uint8),
                    "b_zeros": np.zeros(8 << 20, np.uint8)})
    plans = plan_chunks([(a.source.nbytes, a.source.itemsize, a.source.plane_width) for a in flat.arrays],
                        chunk_bytes=64 << 10, pack_below=16 << 10)
    engine = HostEngine([a.source for a in flat.arrays], codec="zstd", byte_planes="auto", threads=1,
                        adaptive=True)
    try:  # storage waiting at 100 MB/s: 10 ns a byte, zstd on zeros well under that
        result = run_save(plans, engine, ReportingWriter(MemoryStore(), 0, WritePace(0, 1e8)),
                          max_inflight_bytes=1 << 20, index=index_template(flat))
    finally:
        engine.close()
    random_chunks = {segment.chunk for segment in result.segments[0]}
    zero_chunks = sorted(segment.chunk for segment in result.segments[1])
    assert all(result.chunks[c].stored >= result.chunks[c].raw for c in random_chunks)
    whole = [c for c in zero_chunks if result.chunks[c].stored == result.chunks[c].raw]
    assert len(whole) <= 2 * RESAMPLE_EVERY < len(zero_chunks) // 4, (len(whole), len(zero_chunks))
