"""Grouped reads of a GPU restore: runs of consecutive chunks read with one storage call into a
piece of the decoder's read arena (``GpuDecoder.read_arena``), each chunk decoded from its bytes
there, a piece reused only once all its chunks are decoded. Run through the decoder's own logic
on the fake device (tests/fake_device.py) with real files and the POSIX reader's threads; the
same path on real nvCOMP and kvikio is in tests/gpu."""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_device import FakeDevice
from test_fake_device import CHUNK, KIB, TIMEOUT, assert_same, save_through, weights

from gdsckpt.errors import CheckpointError, CorruptCheckpointError
from gdsckpt.format import align_up
from gdsckpt.io.base import StorageReader
from gdsckpt.io.posix import PosixReader
from gdsckpt.pipeline.gpu import GpuDecoder
from gdsckpt.pipeline.gpu.staging import GROUP_READ_PIECES, GROUP_READ_SHARE, arena_pieces
from gdsckpt.pipeline.load import open_file, run_restore, run_verify
from gdsckpt.state import NumpyTarget

PIECE = 4 * CHUNK + 8 * KIB
STAGING = 8 << 20


class RecordingReader(StorageReader):
    """A real file's POSIX reader whose reads complete late, in random order (each on a thread of
    its own after a random pause), recording every call. Fault injection: ``fail_at``, the call
    that fails with EIO instead; ``fail_covering``, a file offset every read of which fails."""

    name = "recording"

    def __init__(self, path: Path, *, seed: int = 0, fail_at: int | None = None,
                 fail_covering: int | None = None):
        self.inner = PosixReader(path, threads=4)
        self.size = self.inner.size
        self.calls: list[tuple[int, int]] = []
        self.fail_at = fail_at
        self.fail_covering = fail_covering
        self._random = random.Random(seed)
        self._pool = ThreadPoolExecutor(8)
        self._lock = threading.Lock()

    def read(self, offset: int, length: int) -> bytes:
        return self.inner.read(offset, length)

    def submit_read(self, offset: int, out: Any) -> Future[Any]:
        with self._lock:
            self.calls.append((offset, out.nbytes))
            failing = ((self.fail_at is not None and len(self.calls) - 1 == self.fail_at)
                       or (self.fail_covering is not None
                           and offset <= self.fail_covering < offset + out.nbytes))
            pause = self._random.uniform(0, 0.004)

        def run() -> Any:
            time.sleep(pause)
            if failing:
                raise OSError(5, "Input/output error (injected)")
            return self.inner.submit_read(offset, out).result(TIMEOUT)
        return self._pool.submit(run)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.inner.close()


def saved_file(tmp_path: Path, state: dict[str, np.ndarray], **options: Any) -> tuple[Path, Any]:
    store, flat, _ = save_through(FakeDevice(), state, **options)
    path = tmp_path / "state.gdsckpt"
    path.write_bytes(store.get("ckpt"))
    return path, flat


def grouped_decoder(device: FakeDevice, piece: int = PIECE, staging: int = STAGING) -> GpuDecoder:
    return GpuDecoder(device_id=0, max_staging_bytes=staging, restore_staging_bytes=staging, timeout=TIMEOUT,
                      device=device, group_read_bytes=piece)


def restore(reader: StorageReader, flat: Any, dec: GpuDecoder,
            windows: dict[int, tuple[int, int]] | None = None, ids: list[int] | None = None) -> dict[str, np.ndarray]:
    index = open_file(reader).index
    chosen = ids if ids is not None else list(range(len(flat.arrays)))
    targets = {}
    for i in chosen:
        array = flat.arrays[i]
        if windows and i in windows:
            start, stop = windows[i]
            targets[i] = NumpyTarget(((stop - start) // np.dtype(array.dtype).itemsize,), array.dtype)
        else:
            targets[i] = NumpyTarget(array.shape, array.dtype)
    try:
        run_restore(reader, index, dec, targets, max_inflight_bytes=1 << 30, timeout=TIMEOUT, windows=windows)
    finally:
        dec.close()
    return {flat.arrays[i].key: targets[i].finish() for i in chosen}


def big_state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    state = weights(seed)
    state["big"] = (rng.standard_normal(400_000) * 0.02).astype(np.float32)  # ~25 chunks
    return state


@pytest.mark.parametrize("codec,byte_planes", [("ans", "auto"), ("zstd", "always"), ("none", "never"),
                                               ("lz4", "never")])
def test_grouped_restore_is_bit_exact_with_fewer_read_calls(tmp_path: Path, codec: str, byte_planes: str) -> None:
    state = big_state()
    path, flat = saved_file(tmp_path, state, codec=codec, byte_planes=byte_planes)
    with RecordingReader(path) as reader:
        chunks = open_file(reader).index.chunks
        reader.calls.clear()
        dec = grouped_decoder(FakeDevice())
        got = restore(reader, flat, dec)
        calls = list(reader.calls)
    assert_same(got, state)
    assert dec.arena is None  # closed with the decoder
    assert len(calls) < len(chunks) / 2, (len(calls), len(chunks))
    assert all(length <= PIECE for _offset, length in calls)
    # the calls cover every chunk's padded bytes exactly once, in file order
    covered = sorted(calls)
    assert covered[0][0] == min(c.offset for c in chunks)
    for (offset, length), (next_offset, _next) in itertools.pairwise(covered):
        assert offset + length == next_offset
    last = max(chunks, key=lambda c: c.offset)
    assert covered[-1][0] + covered[-1][1] == last.offset + align_up(last.stored)


def test_pieces_are_reused_only_after_their_chunks_are_decoded(tmp_path: Path) -> None:
    """Two pieces for ~30 chunks: every piece is read into many times, with reads finishing late
    and out of order; a piece overwritten before its chunks were decoded would fail a checksum or
    restore other bytes."""
    state = big_state(1)
    path, flat = saved_file(tmp_path, state, codec="zstd")
    staging = GROUP_READ_SHARE * 2 * PIECE  # exactly two pieces
    for seed in range(4):
        with RecordingReader(path, seed=seed) as reader:
            dec = grouped_decoder(FakeDevice(), staging=staging)
            index = open_file(reader).index
            reader.calls.clear()
            got = restore(reader, flat, dec)
            assert_same(got, state)
            assert dec.ring is None or dec.ring.free_slots() == dec.ring.slots
            assert len(reader.calls) >= 4 and len(reader.calls) < len(index.chunks)


def test_arena_and_ring_stay_within_the_restore_staging_budget(tmp_path: Path) -> None:
    state = big_state(2)
    path, _flat = saved_file(tmp_path, state, codec="ans")
    device = FakeDevice()
    dec = grouped_decoder(device, staging=STAGING)
    with PosixReader(path) as reader:
        index = open_file(reader).index
        dec.reserve_reads(index.chunks, ["nvcomp.ans/1"])
        assert dec.arena is not None and dec.ring is not None
        assert dec.arena.pieces == min(GROUP_READ_PIECES, STAGING // GROUP_READ_SHARE // PIECE)
        assert dec.staging_bytes == dec.ring.nbytes + dec.arena.nbytes <= STAGING
        assert dec.arena.nbytes <= STAGING // GROUP_READ_SHARE
    dec.close()


def test_no_arena_where_the_budget_or_the_piece_is_too_small(tmp_path: Path) -> None:
    state = big_state(3)
    path, flat = saved_file(tmp_path, state, codec="ans")
    with RecordingReader(path) as reader:
        chunks = open_file(reader).index.chunks
        reader.calls.clear()
        dec = grouped_decoder(FakeDevice(), staging=GROUP_READ_SHARE * PIECE)  # one piece fits: none
        got = restore(reader, flat, dec)
        assert_same(got, state)
        assert len(reader.calls) == len(chunks)  # one read per chunk, as without an arena
    # as many pieces as the budget's share holds, up to GROUP_READ_PIECES
    assert arena_pieces(1 << 30, 64 << 20, 16 << 20) == 4
    assert arena_pieces(8 << 30, 64 << 20, 16 << 20) == GROUP_READ_PIECES == 16
    assert arena_pieces(64 << 30, 64 << 20, 16 << 20) == GROUP_READ_PIECES
    assert arena_pieces(1 << 30, 64 << 20, 40 << 20) == 0  # a piece holds fewer than two chunks
    assert arena_pieces(GROUP_READ_SHARE * (64 << 20), 64 << 20, 1 << 20) == 0
    assert arena_pieces(GROUP_READ_SHARE * 2 * (64 << 20), 64 << 20, 1 << 20) == 2


def test_partial_restores_group_only_neighbouring_chunks(tmp_path: Path) -> None:
    """A restore of some arrays (and a window of one) reads only their chunks: no call spans a
    chunk the restore does not need."""
    state = big_state(4)
    path, flat = saved_file(tmp_path, state, codec="zstd")
    keys = [a.key for a in flat.arrays]
    wanted = [keys.index("big"), keys.index("w16")]
    window = {keys.index("big"): (CHUNK * 3 + 40, state["big"].nbytes - CHUNK * 5 - 8)}
    with RecordingReader(path) as reader:
        index = open_file(reader).index
        needed = {s.chunk for i in wanted for s in index.tensors[i].segments}
        reader.calls.clear()
        got = restore(reader, flat, grouped_decoder(FakeDevice()), windows=window, ids=wanted)
        calls = list(reader.calls)
    assert got["w16"].tobytes() == state["w16"].tobytes()
    start, stop = window[keys.index("big")]
    assert got["big"].tobytes() == state["big"].tobytes()[start:stop]
    spans = [(c.offset, c.offset + align_up(c.stored)) for i, c in enumerate(index.chunks) if i not in needed]
    for offset, length in calls:
        assert not any(offset < high and low < offset + length for low, high in spans)
    assert len(calls) < len(needed)


def test_a_damaged_chunk_inside_a_group_names_that_chunk(tmp_path: Path) -> None:
    state = big_state(5)
    path, flat = saved_file(tmp_path, state, codec="zstd")
    with PosixReader(path) as reader:
        index = open_file(reader).index
    victim = len(index.chunks) // 2
    record = index.chunks[victim]
    data = bytearray(path.read_bytes())
    data[record.offset + record.stored // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with RecordingReader(path) as reader:
        with pytest.raises(CorruptCheckpointError) as caught:
            restore(reader, flat, grouped_decoder(FakeDevice()))
        assert len(reader.calls) < len(index.chunks)
    assert caught.value.chunk == victim


def test_a_failed_grouped_read_is_read_again_chunk_by_chunk(tmp_path: Path) -> None:
    """One grouped call fails once (EIO): its chunks are read again one by one and the restore
    completes, bit-exact, instead of discarding an intact file."""
    state = big_state(6)
    path, flat = saved_file(tmp_path, state, codec="ans")
    with RecordingReader(path) as reader:
        index = open_file(reader).index
        reader.calls.clear()
        reader.fail_at = 1  # the restore's second grouped call
        got = restore(reader, flat, grouped_decoder(FakeDevice()))
        calls = list(reader.calls)
    assert_same(got, state)
    failed_offset, failed_length = calls[1]
    spanned = [c for c in index.chunks if failed_offset <= c.offset < failed_offset + failed_length]
    assert len(spanned) >= 2, "the failed call held one chunk: nothing grouped"
    for record in spanned:  # each read again on its own
        assert (record.offset, align_up(record.stored)) in calls[2:], record


def chunk_inside_a_group(path: Path, flat: Any) -> tuple[Any, int]:
    """The file's index and a chunk in the middle of the file that a clean grouped restore reads
    inside a group (not as a group's first chunk)."""
    with RecordingReader(path) as reader:
        index = open_file(reader).index
        reader.calls.clear()
        restore(reader, flat, grouped_decoder(FakeDevice()))
        calls = list(reader.calls)
    inside = [i for i, c in enumerate(index.chunks)
              if any(offset < c.offset < offset + length for offset, length in calls)]
    assert inside, "no group held more than one chunk"
    return index, inside[len(inside) // 2]


def test_an_unreadable_chunk_inside_a_group_is_the_one_named(tmp_path: Path) -> None:
    """Every read of one chunk's bytes fails: the grouped call holding it does, and so does the
    chunk's own read after it; the error names that chunk, not the group's first."""
    state = big_state(8)
    path, flat = saved_file(tmp_path, state, codec="ans")
    index, victim = chunk_inside_a_group(path, flat)
    record = index.chunks[victim]
    with RecordingReader(path, fail_covering=record.offset + record.stored // 2) as reader:
        with pytest.raises(CheckpointError, match=f"I/O error reading chunk {victim} ") as caught:
            restore(reader, flat, grouped_decoder(FakeDevice()))
        assert (record.offset, align_up(record.stored)) in reader.calls  # read again on its own
    assert isinstance(caught.value.__cause__, OSError)


def test_a_file_cut_inside_a_group_names_the_chunk_it_ends_in(tmp_path: Path) -> None:
    """The file is truncated after its index was read, half-way through a chunk in the middle
    of a group: the chunks before it are read again on their own, and the error names the cut
    chunk (``CorruptCheckpointError.chunk``)."""
    state = big_state(9)
    path, flat = saved_file(tmp_path, state, codec="zstd")
    index, cut = chunk_inside_a_group(path, flat)
    record = index.chunks[cut]
    with RecordingReader(path) as reader:
        submit_read = reader.submit_read

        def cut_then_read(offset: int, out: Any) -> Future[Any]:
            if not reader.calls:  # the restore's first chunk read: its index was read already
                os.truncate(path, record.offset + record.stored // 2)
            return submit_read(offset, out)

        reader.calls.clear()
        reader.submit_read = cut_then_read  # type: ignore[method-assign]
        with pytest.raises(CorruptCheckpointError) as caught:
            restore(reader, flat, grouped_decoder(FakeDevice()))
        assert any(offset < record.offset < offset + length for offset, length in reader.calls)
    assert caught.value.chunk == cut, str(caught.value)


def test_verify_reads_grouped_too(tmp_path: Path) -> None:
    state = big_state(7)
    path, _flat = saved_file(tmp_path, state, codec="ans")
    with RecordingReader(path) as reader:
        index = open_file(reader).index
        reader.calls.clear()
        dec = grouped_decoder(FakeDevice())
        try:
            stored = run_verify(reader, index, dec, max_inflight_bytes=1 << 30, timeout=TIMEOUT)
        finally:
            dec.close()
        assert stored == sum(c.stored for c in index.chunks)
        assert len(reader.calls) < len(index.chunks) / 2
