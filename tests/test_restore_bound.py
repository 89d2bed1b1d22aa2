"""The restore driver honours an engine's bound on outstanding chunks (``Engine.reserve_reads``):
the GPU engine's read ring has a fixed number of slots and a read buffer is only handed out for a
free one, so the driver must never want more. Exercised here with the real CPU engine and POSIX
reader, counting the chunks between ``read_buffer`` and the end of their decode."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gdsckpt
from gdsckpt.format.index import ChunkRecord
from gdsckpt.io.posix import PosixReader
from gdsckpt.pipeline.engine import HostEngine
from gdsckpt.pipeline.load import open_file, run_restore, run_verify
from gdsckpt.state import NumpyTarget


class SlotCountingEngine(HostEngine):
    """A CPU engine that declares ``slots`` and records the most chunks outstanding at once."""

    def __init__(self, slots: int) -> None:
        super().__init__([], codec="none", byte_planes="never", threads=4)
        self.slots = slots
        self.reserved: list[ChunkRecord] = []
        self.outstanding = 0
        self.peak = 0
        self.lock = threading.Lock()

    def reserve_reads(self, records: list[ChunkRecord], codecs: Any = ()) -> int | None:
        self.reserved = list(records)
        self.codecs = list(codecs)
        return self.slots

    def read_buffer(self, nbytes: int) -> Any:
        with self.lock:
            self.outstanding += 1
            self.peak = max(self.peak, self.outstanding)
        return super().read_buffer(nbytes)

    def submit_decode(self, record: ChunkRecord, chain: list[dict[str, Any]], stored: Any,
                      deliver: Callable[[Any], None], *, to_host: bool = False,
                      places: list[tuple[int, int, int]] | None = None,
                      into: Any = None) -> Future[None]:
        def counted(raw: Any) -> None:
            deliver(raw)
            with self.lock:  # the slot is free before the future completes, as on the GPU
                self.outstanding -= 1
        # ``into`` is not passed on: every chunk then goes through ``deliver``, which counts it
        return super().submit_decode(record, chain, stored, counted, to_host=to_host, places=places)


@pytest.mark.parametrize("slots", [1, 2, 5])
def test_restore_never_exceeds_the_engines_slots(tmp_path: Path, slots: int) -> None:
    rng = np.random.default_rng(0)
    state = {"a": rng.standard_normal(40_000), "b": rng.standard_normal(9_000).astype(np.float32)}
    path = tmp_path / "x.gdsckpt"
    gdsckpt.save(state, path, codec="zstd", chunk_bytes=16384)
    with PosixReader(path, threads=8) as reader:
        index = open_file(reader).index
        assert len(index.chunks) > 3 * slots
        targets = {i: NumpyTarget(r.shape, r.dtype) for i, r in enumerate(index.tensors)}
        engine = SlotCountingEngine(slots)
        try:
            run_restore(reader, index, engine, targets, max_inflight_bytes=1 << 30, timeout=60)
        finally:
            engine.close()
        assert 1 <= engine.peak <= slots
        assert engine.outstanding == 0
        assert [r.offset for r in engine.reserved] == sorted(c.offset for c in index.chunks)
        assert engine.codecs and set(engine.codecs) <= {"zstd/1", "none/1"}
        for i, record in enumerate(index.tensors):
            assert targets[i].finish().tobytes() == state[record.key].tobytes()
        verifier = SlotCountingEngine(slots)
        try:
            run_verify(reader, index, verifier, max_inflight_bytes=1 << 30, timeout=60)
        finally:
            verifier.close()
        assert 1 <= verifier.peak <= slots and len(verifier.reserved) == len(index.chunks)


def test_staging_ring_leaves_room_for_nvcomps_measured_scratch() -> None:
    from gdsckpt.pipeline.gpu import DECODE_SCRATCH, decode_scratch, encode_scratch, ring_slots

    mib = 1 << 20
    slot = 32 * mib  # a 16 MiB chunk and its compressed bound
    ans = encode_scratch(["ans"], 16 * mib)
    assert ring_slots(1024 * mib, slot, ans) == (int(1024 * mib * 0.9) - ans[0]) // slot
    deflate = encode_scratch(["deflate"], 16 * mib)
    slots = ring_slots(1024 * mib, slot, deflate)
    assert deflate[0] + slots * (slot + deflate[1]) <= 1024 * mib * 0.9 < deflate[0] + (slots + 1) * (slot + deflate[1])
    # Zstd's fixed scratch alone exceeds a 1 GiB budget: two slots, the minimum that overlaps.
    assert ring_slots(1024 * mib, slot, encode_scratch(["zstd"], 16 * mib)) == 2
    # Smaller chunks scale the scratch per chunk down, not its fixed part (measured: the same for
    # 64 KiB and 16 MiB chunks, both ways); decode scratch counts the worst codec present.
    assert encode_scratch(["zstd"], 4 * mib) == (1120 * mib, 6 * mib)
    assert decode_scratch(["zstd/1"], 4 * mib) == (96 * mib, 12 * mib)
    # a CPU engine's file may hold chunks above nvCOMP's 16 MiB: they count in proportion (the
    # scratch is three bytes per byte of a batch), not as 16 MiB ones
    assert decode_scratch(["zstd/1"], 64 * mib) == (96 * mib, 192 * mib)
    assert decode_scratch(["none/1", "zstd/1"], 16 * mib) == DECODE_SCRATCH["zstd/1"]
    assert ring_slots(1024 * mib, slot, (0, 0), most=3) == 3
