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
from gdsckpt.format import HEADER_REGION, TRAILER_SIZE, align_up
from gdsckpt.io.base import StorageReader
from gdsckpt.io.posix import PosixReader
from gdsckpt.pipeline.gpu import GpuDecoder
from gdsckpt.pipeline.gpu.staging import (
    GROUP_READ_PIECES,
    GROUP_READ_SHARE,
    LeadRead,
    arena_pieces,
    lead_read_pieces,
)
from gdsckpt.pipeline.load import open_file, run_restore, run_verify
from gdsckpt.state import NumpyTarget

pytestmark = pytest.mark.usefixtures("nvcomp_scratch_at_fake_scale")

PIECE = 4 * CHUNK + 8 * KIB
STAGING = 8 << 20


class RecordingReader(StorageReader):
    """A real file's POSIX reader whose reads complete late, in random order (each on a thread of
    its own after a random pause), recording every call. Fault injection: ``fail_at``, the call
    that fails with EIO instead; ``fail_covering``, a file offset every read of which fails."""

    name = "recording"

    def __init__(self, path: Path, *, seed: int = 0, fail_at: int | None = None,
                 fail_covering: int | None = None, slow: tuple[int, ...] = (), slow_seconds: float = 0.05):
        self.inner = PosixReader(path, threads=4)
        self.size = self.inner.size
        self.calls: list[tuple[int, int]] = []
        self.fail_at = fail_at
        self.fail_covering = fail_covering
        self.slow = slow
        """Calls (by number) that pause ``slow_seconds`` (a lead read still running when the restore
        starts)."""
        self.slow_seconds = slow_seconds
        self.overlaps: list[tuple[int, int]] = []
        """Calls (offset, bytes) submitted into memory that a read still running fills."""
        self._running: dict[int, tuple[int, int]] = {}
        self._random = random.Random(seed)
        self._pool = ThreadPoolExecutor(8)
        self._lock = threading.Lock()

    def read(self, offset: int, length: int) -> bytes:
        return self.inner.read(offset, length)

    def submit_read(self, offset: int, out: Any) -> Future[Any]:
        low = int(out.__array_interface__["data"][0])
        span = (low, low + out.nbytes)
        with self._lock:
            number = len(self.calls)
            self.calls.append((offset, out.nbytes))
            if any(span[0] < high and start < span[1] for start, high in self._running.values()):
                self.overlaps.append((offset, out.nbytes))
            self._running[number] = span
            failing = ((self.fail_at is not None and number == self.fail_at)
                       or (self.fail_covering is not None
                           and offset <= self.fail_covering < offset + out.nbytes))
            pause = self.slow_seconds if number in self.slow else self._random.uniform(0, 0.004)

        def run() -> Any:
            try:
                time.sleep(pause)
                if failing:
                    raise OSError(5, "Input/output error (injected)")
                return self.inner.submit_read(offset, out).result(TIMEOUT)
            finally:
                with self._lock:
                    del self._running[number]
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


def test_the_arena_never_outgrows_the_bytes_to_read(tmp_path: Path) -> None:
    """Under a large restore budget (the default is a quarter of the free device memory, up to
    8 GiB) the arena took all 16 pieces whatever the restore: ``load`` of a 1.87 MB file held 1 GiB
    of device memory. It now takes at most the pieces the chunks to read fill, and one more (a
    group across a boundary); a restore that fills less than two reads chunk by chunk. Both
    restore bit-exact."""
    state = big_state(5)
    path, flat = saved_file(tmp_path, state, codec="ans")
    with RecordingReader(path) as reader:
        index = open_file(reader).index
        stored = sum(align_up(chunk.stored) for chunk in index.chunks)
        dec = grouped_decoder(FakeDevice(), staging=64 * STAGING)
        dec.reserve_reads(index.chunks, ["nvcomp.ans/1"])
        assert dec.arena is not None and dec.arena.pieces == -(-stored // PIECE) + 1 < GROUP_READ_PIECES
        dec.close()
        device = FakeDevice()
        assert_same(restore(reader, flat, grouped_decoder(device, staging=64 * STAGING)), state)
        assert device.peak_bytes < 2 * stored + 64 * STAGING // 8
        small = grouped_decoder(FakeDevice(), staging=64 * STAGING, piece=align_up(stored // 2 + 4096))
        small.reserve_reads(index.chunks, ["nvcomp.ans/1"])
        assert small.arena is None  # less than two pieces to read
        small.close()


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


# ---------------------------------------------------------------------------------------------
# lead reads: the data region's first pieces read while the index is parsed (``LeadRead``)


def lead_of(reader: StorageReader, device: FakeDevice, length: int, piece: int = PIECE) -> LeadRead:
    return LeadRead(device, reader, HEADER_REGION, min(length, reader.size - HEADER_REGION - TRAILER_SIZE), piece,
                    timeout=TIMEOUT)


def lead_decoder(device: FakeDevice, lead: LeadRead | None, staging: int = STAGING,
                 piece: int = PIECE) -> GpuDecoder:
    return GpuDecoder(device_id=0, max_staging_bytes=staging, restore_staging_bytes=staging, timeout=TIMEOUT,
                      device=device, group_read_bytes=piece, lead=lead)


def inside(index: Any, end: int) -> list[Any]:
    """The chunks whose padded bytes lie wholly before ``end``."""
    return [c for c in index.chunks if c.offset + align_up(c.stored) <= end]


@pytest.mark.parametrize("seed", range(3))
def test_a_lead_read_serves_every_chunk_inside_it(tmp_path: Path, seed: int) -> None:
    """The lead's pieces are read first, late and out of order; no chunk inside them is read again
    (those crossing two pieces wait for both), the reads after them start at the first chunk
    outside, the restore is bit-exact, and the arena with the lead stays within the budget."""
    state = big_state(10 + seed)
    path, flat = saved_file(tmp_path, state, codec="zstd")
    with RecordingReader(path, seed=seed, slow=(1 + seed % 2,)) as reader:  # a later piece lands last
        index = open_file(reader).index
        reader.calls.clear()
        device = FakeDevice()
        lead = lead_of(reader, device, 3 * PIECE)
        dec = lead_decoder(device, lead)
        got = restore(reader, flat, dec)
        lead.close()
        calls = list(reader.calls)
        assert not reader.overlaps
    assert_same(got, state)
    assert dec.staging_bytes <= STAGING
    assert calls[:3] == [(HEADER_REGION + i * PIECE, PIECE) for i in range(3)]
    end = HEADER_REGION + 3 * PIECE
    served = inside(index, end)
    assert len(served) >= 8
    assert any(c.offset // PIECE != (c.offset + c.stored) // PIECE for c in served), "no chunk crosses two pieces"
    later = calls[3:]
    for chunk in served:
        assert not any(offset <= chunk.offset < offset + length for offset, length in later), chunk
    assert min(offset for offset, _length in later) == min(c.offset for c in index.chunks if c not in served)


def test_a_lead_read_of_the_whole_file_leaves_no_read_to_do(tmp_path: Path) -> None:
    state = big_state(13)
    path, flat = saved_file(tmp_path, state, codec="ans")
    with RecordingReader(path) as reader:
        device = FakeDevice()
        lead = lead_of(reader, device, reader.size)
        staging = 16 * PIECE
        # more pieces than the arena's usual share, within the lead's
        assert arena_pieces(staging, PIECE, CHUNK) < lead.pieces <= lead_read_pieces(staging, PIECE)
        dec = lead_decoder(device, lead, staging=staging)
        got = restore(reader, flat, dec)
        lead.close()
        assert len(reader.calls) == lead.pieces
    assert_same(got, state)
    assert dec.staging_bytes <= staging


@pytest.mark.parametrize("seed", range(3))
def test_unused_lead_pieces_take_new_reads_only_once_theirs_ended(tmp_path: Path, seed: int) -> None:
    """A partial restore needs none of the lead's chunks; the lead's reads are slow. Its pieces
    are the arena's only two: a new read into one while the lead's read still fills it would
    mix the two (the reader records any read submitted into memory a running read fills)."""
    state = big_state(20 + seed)
    path, flat = saved_file(tmp_path, state, codec="zstd")
    keys = [a.key for a in flat.arrays]
    big = keys.index("big")
    staging = GROUP_READ_SHARE * 2 * PIECE
    with RecordingReader(path, seed=seed, slow=(0, 1)) as reader:
        index = open_file(reader).index
        end = HEADER_REGION + 2 * PIECE
        window = {big: (state["big"].nbytes // 2, state["big"].nbytes)}
        position, needed = 0, []
        for segment in index.tensors[big].segments:
            if position + segment.length > window[big][0]:
                needed.append(index.chunks[segment.chunk])
            position += segment.length
        assert all(c.offset >= end for c in needed)
        reader.calls.clear()
        device = FakeDevice()
        lead = lead_of(reader, device, 2 * PIECE)
        dec = lead_decoder(device, lead, staging=staging)
        got = restore(reader, flat, dec, windows=window, ids=[big])
        lead.close()
        assert not reader.overlaps, reader.overlaps
        assert len(reader.calls) > 4  # the two pieces were read into again
    assert got["big"].tobytes() == state["big"].tobytes()[window[big][0]:]


def test_a_hung_lead_read_fails_the_restore_instead_of_taking_a_new_read(tmp_path: Path) -> None:
    """A lead piece no chunk needs, whose read outlasts the restore's timeout: the restore raises
    ``TimeoutError`` rather than read into the piece (the hung read may still fill it)."""
    state = big_state(24)
    path, flat = saved_file(tmp_path, state, codec="zstd")
    keys = [a.key for a in flat.arrays]
    big = keys.index("big")
    window = {big: (state["big"].nbytes // 2, state["big"].nbytes)}
    with RecordingReader(path, slow=(0, 1), slow_seconds=1.0) as reader:
        index = open_file(reader).index
        device = FakeDevice()
        lead = lead_of(reader, device, 2 * PIECE)
        dec = lead_decoder(device, lead, staging=GROUP_READ_SHARE * 2 * PIECE)
        target = NumpyTarget(((window[big][1] - window[big][0]) // 4,), flat.arrays[big].dtype)
        try:
            # the builtin TimeoutError, saying what timed out (on Python 3.10 the future's own,
            # another class, escaped: a caller's ``except TimeoutError`` missed it)
            with pytest.raises(TimeoutError, match="lead read was not read within 0.2 s") as raised:
                run_restore(reader, index, dec, {big: target}, max_inflight_bytes=1 << 30, timeout=0.2,
                            windows=window)
            assert type(raised.value) is TimeoutError
        finally:
            dec.close()
            lead.close()
        assert not reader.overlaps, reader.overlaps
        assert len(reader.calls) == 2  # no read went into either piece


def test_a_hung_lead_read_that_chunks_need_fails_the_restore_once(tmp_path: Path) -> None:
    """The lead's first piece, which the file's first chunks lie in, is read for longer than the
    restore's timeout: the restore raises one ``TimeoutError`` naming a chunk, and the closes that
    follow (the decoder's, whose arena adopted the lead, then the starter's) neither wait for that
    read again nor raise their own error, which would replace the restore's. The running read
    keeps its buffer."""
    state = big_state(25)
    path, flat = saved_file(tmp_path, state, codec="zstd")
    with RecordingReader(path, slow=(0,), slow_seconds=1.5) as reader:
        index = open_file(reader).index
        device = FakeDevice()
        # the restore's timeout for the lead too, as ``api.resolve.lead_read`` gives it
        lead = LeadRead(device, reader, HEADER_REGION, 2 * PIECE, PIECE, timeout=0.2)
        dec = lead_decoder(device, lead, staging=GROUP_READ_SHARE * 4 * PIECE)
        targets = {i: NumpyTarget(a.shape, a.dtype) for i, a in enumerate(flat.arrays)}
        try:
            with pytest.raises(TimeoutError, match=r"chunk \d+ \(tensor '.*'\) was not read and decoded"):
                run_restore(reader, index, dec, targets, max_inflight_bytes=1 << 30, timeout=0.2)
            assert reader.stalled
            dec.close()
            lead.close()
            assert 0 in reader._running, "a close waited for the hung read"
            assert lead.buffer is not None  # still filled by that read
        finally:
            dec.close()
            lead.close()


def test_a_failed_lead_read_is_read_again_chunk_by_chunk(tmp_path: Path) -> None:
    """The lead's first piece fails (EIO): its chunks are read again on their own and the restore
    completes, bit-exact; a chunk crossing into the second piece waits for that read too."""
    state = big_state(14)
    path, flat = saved_file(tmp_path, state, codec="ans")
    with RecordingReader(path, fail_at=0) as reader:
        index = open_file(reader).index
        reader.calls.clear()
        device = FakeDevice()
        lead = lead_of(reader, device, 2 * PIECE)
        got = restore(reader, flat, lead_decoder(device, lead))
        lead.close()
        calls = list(reader.calls)
        assert not reader.overlaps
    assert_same(got, state)
    in_first = [c for c in inside(index, HEADER_REGION + 2 * PIECE) if c.offset < HEADER_REGION + PIECE]
    assert len(in_first) >= 2
    for chunk in in_first:
        assert (chunk.offset, align_up(chunk.stored)) in calls[2:], chunk


def test_an_unreadable_chunk_in_a_lead_read_is_the_one_named(tmp_path: Path) -> None:
    state = big_state(15)
    path, flat = saved_file(tmp_path, state, codec="ans")
    with PosixReader(path) as plain:
        index = open_file(plain).index
    victim = len(inside(index, HEADER_REGION + 2 * PIECE)) // 2
    record = index.chunks[victim]
    with RecordingReader(path, fail_covering=record.offset + record.stored // 2) as reader:
        device = FakeDevice()
        lead = lead_of(reader, device, 2 * PIECE)
        with pytest.raises(CheckpointError, match=f"I/O error reading chunk {victim} "):
            restore(reader, flat, lead_decoder(device, lead))
        lead.close()
        assert (record.offset, align_up(record.stored)) in reader.calls


def test_a_lead_the_decoder_cannot_hold_is_left_unused(tmp_path: Path) -> None:
    """A decoder whose pieces are of another size reads every chunk as usual; the lead's starter
    still closes it after its reads."""
    state = big_state(16)
    path, flat = saved_file(tmp_path, state, codec="zstd")
    with RecordingReader(path) as reader:
        index = open_file(reader).index
        reader.calls.clear()
        device = FakeDevice()
        lead = lead_of(reader, device, 2 * PIECE)
        dec = lead_decoder(device, lead, piece=2 * PIECE)
        got = restore(reader, flat, dec)
        later = reader.calls[2:]
        lead.close()
        assert lead.buffer is None and not reader.overlaps
    assert_same(got, state)
    assert min(offset for offset, _length in later) == index.chunks[0].offset


def test_lead_reads_stay_within_half_of_the_least_budget() -> None:
    assert lead_read_pieces(1 << 30, 64 << 20) == 8  # the default max_staging_bytes: 512 MiB
    assert lead_read_pieces(8 << 30, 64 << 20) == GROUP_READ_PIECES
    assert lead_read_pieces(256 << 20, 64 << 20) == 2
    assert lead_read_pieces(128 << 20, 64 << 20) == 0  # one piece: none
    for floor in (1 << 28, 3 << 29, 1 << 30, 5 << 30):
        assert lead_read_pieces(floor, 64 << 20) * (64 << 20) <= floor // 2


def test_a_lead_read_close_waits_for_its_reads() -> None:
    """``close`` never releases the buffer under a running read: past its timeout it raises and
    keeps the buffer (a later close raises at once: one wait per hung read); once the read ends it
    releases it."""
    release = threading.Event()

    class HeldReader(StorageReader):
        name = "held"
        size = 1 << 20

        def read(self, offset: int, length: int) -> bytes:
            raise AssertionError("not called")

        def submit_read(self, offset: int, out: Any) -> Future[Any]:
            future: Future[Any] = Future()
            threading.Thread(target=lambda: (release.wait(TIMEOUT), future.set_result(out)), daemon=True).start()
            return future

        def close(self) -> None:
            pass

    lead = LeadRead(FakeDevice(), HeldReader(), HEADER_REGION, 3 * KIB, KIB, timeout=0.05)
    assert lead.pieces == 3 and len(lead.futures) == 3
    with pytest.raises(TimeoutError, match="lead read still running"):
        lead.close()
    assert lead.buffer is not None
    with pytest.raises(TimeoutError, match="lead read still running"):
        lead.close()  # a second close does not wait a second timeout for the same read
    release.set()
    for future in lead.futures:
        future.result(TIMEOUT)
    lead.close()
    assert lead.buffer is None


def test_lead_reads_only_where_the_gpu_is_known_and_the_file_local(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``api.resolve.lead_read`` yields None (and starts nothing) for a CPU restore, a source that
    is not a local path, a file too short to hold a data region, a configuration whose least
    budget holds no two pieces, or with lead reads turned off."""
    from gdsckpt.api import resolve
    from gdsckpt.config import Config

    path, _flat = saved_file(tmp_path, big_state(17), codec="zstd")
    short = tmp_path / "short.gdsckpt"
    short.write_bytes(path.read_bytes()[:HEADER_REGION + TRAILER_SIZE])
    with PosixReader(path) as reader, PosixReader(short) as cut:
        cases = [(path, Config(), reader, None), (path.read_bytes(), Config(), reader, 0),
                 ("s3://bucket/key", Config(), reader, 0), (short, Config(), cut, 0),
                 (path, Config(max_staging_bytes=64 << 20), reader, 0)]
        for source, config, opened, gpu_device in cases:
            with resolve.lead_read(source, config, opened, gpu_device) as lead:
                assert lead is None, (source, config)
        monkeypatch.setattr(resolve, "LEAD_READS", False)
        with resolve.lead_read(path, Config(), reader, 0) as lead:
            assert lead is None


def test_a_lead_the_decoder_cannot_hold_goes_before_its_ring_is_allocated(tmp_path: Path) -> None:
    """The lead takes half of the budget and the decoder's pieces are of another size (no arena):
    its ring fills the budget, so the lead must be released (once its reads end) before the ring
    is allocated, or the two together exceed the budget."""
    state = big_state(30)
    path, flat = saved_file(tmp_path, state, codec="ans")  # no decode scratch: the ring takes the budget
    staging = 8 * PIECE
    with RecordingReader(path, slow=(0,)) as reader:
        device = FakeDevice()
        lead = lead_of(reader, device, lead_read_pieces(staging, PIECE) * PIECE)
        dec = lead_decoder(device, lead, staging=staging, piece=2 * PIECE)
        got = restore(reader, flat, dec)
        assert lead.buffer is None and not reader.overlaps
        lead.close()  # the starter's close: nothing left to do
    assert_same(got, state)
    assert dec.staging_bytes > staging // 2  # the ring alone takes more than the lead left
    assert device.peak_bytes <= staging, (device.peak_bytes, staging)


def test_an_adopted_lead_goes_with_its_arena(tmp_path: Path) -> None:
    """A ``load_into`` restores in phases, each with a decoder of its own: the lead the first
    phase's arena adopted is released when that decoder closes, so the next phase's ring and
    arena have the whole budget to themselves."""
    state = big_state(31)
    path, flat = saved_file(tmp_path, state, codec="zstd")
    staging = 16 * PIECE
    ids = list(range(len(flat.arrays)))
    with RecordingReader(path) as reader:
        device = FakeDevice()
        lead = lead_of(reader, device, lead_read_pieces(staging, PIECE) * PIECE)
        first = restore(reader, flat, lead_decoder(device, lead, staging=staging), ids=ids[:1])
        assert lead.buffer is None  # closed with the first decoder's arena
        assert device.live_bytes == 0, device.live_bytes
        second = restore(reader, flat, lead_decoder(device, None, staging=staging), ids=ids[1:])
        lead.close()
    assert_same({**first, **second}, state)
    assert device.peak_bytes <= staging, (device.peak_bytes, staging)


@pytest.mark.parametrize("codec", ["ans", "zstd", "none"])
@pytest.mark.parametrize("with_lead", [False, True])
@pytest.mark.parametrize("partial", [False, True])
def test_device_memory_in_use_never_exceeds_the_staging_budget(tmp_path: Path, codec: str, with_lead: bool,
                                                               partial: bool) -> None:
    """What the decoder holds at any moment (ring, arena, a lead, any temporary: the fake device's
    peak of live allocations) stays within the restore's staging budget, whatever its share."""
    state = big_state(40)
    path, flat = saved_file(tmp_path, state, codec=codec)
    staging = 8 * PIECE
    keys = [a.key for a in flat.arrays]
    ids = [keys.index("big"), keys.index("w32")] if partial else None
    with RecordingReader(path, seed=3) as reader:
        device = FakeDevice()
        lead = lead_of(reader, device, lead_read_pieces(staging, PIECE) * PIECE) if with_lead and not partial else None
        got = restore(reader, flat, lead_decoder(device, lead, staging=staging), ids=ids)
        if lead is not None:
            lead.close()
    assert_same(got, {k: state[k] for k in got})
    assert device.peak_bytes <= staging, (device.peak_bytes, staging)


def test_a_hung_chunk_read_is_a_timeout_naming_its_chunk(tmp_path: Path) -> None:
    """A chunk read that outlasts the restore's timeout fails the restore with ``TimeoutError``
    (docs/troubleshooting.md), naming the chunk and its tensor, and its memory takes no second
    read (the hung read may still fill it)."""
    state = big_state(25)
    path, flat = saved_file(tmp_path, state, codec="zstd")
    with RecordingReader(path, slow=(3,), slow_seconds=1.0) as reader:
        index = open_file(reader).index
        reader.calls.clear()
        dec = grouped_decoder(FakeDevice())
        targets = {i: NumpyTarget(a.shape, a.dtype) for i, a in enumerate(flat.arrays)}
        try:
            with pytest.raises(TimeoutError, match=r"chunk \d+ \(tensor '\w+'\) was not read and decoded within 0.2 s"):
                run_restore(reader, index, dec, targets, max_inflight_bytes=1 << 30, timeout=0.2)
        finally:
            dec.close()
        assert not reader.overlaps, reader.overlaps
