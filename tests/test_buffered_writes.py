"""Chunks stored as they are, written from the state's own memory with write-back started at once
(``gdsckpt.io.posix``: "Two ways to write a chunk durably"; ``HostEngine.as_is_views``).

Everything here is real: files, ``sync_file_range``, fsync, the save pipeline. The only wrapper
is a spy that records which ranges ``start_write_back`` was asked for and then calls the real one.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gdsckpt
from gdsckpt.api.checkpoint import opened_file
from gdsckpt.io import posix
from gdsckpt.io.memory import MemoryStore, MemoryWriter
from gdsckpt.io.posix import WRITEBACK_MIN_BYTES, PosixWriter

CHUNK = 1 << 20


def _off_page(array: np.ndarray) -> np.ndarray:
    """``array``'s values in memory that starts one element past a page boundary: a chunk written
    from it is never aligned for O_DIRECT, whatever address the allocator hands out (a large
    array's memory is sometimes page-aligned, and its chunks then took the O_DIRECT path)."""
    flat = array.reshape(-1)
    room = np.empty(flat.size + 4096 // flat.itemsize + 1, dtype=flat.dtype)
    skip = (-room.ctypes.data % 4096) // flat.itemsize + 1
    view = room[skip:skip + flat.size]
    view[...] = flat
    return view.reshape(array.shape)


def _state() -> dict[str, Any]:
    """Arrays whose byte sizes are not multiples of 4096, in memory off page boundaries, so chunks
    written from their memory are buffered, end between pages and the next starts after a gap."""
    rng = np.random.default_rng(11)
    return {"w": _off_page(rng.standard_normal(700_003).astype(np.float32)),
            "n": np.array([np.nan, -0.0, 0.0, np.inf], dtype=np.float32).view(np.uint32).copy(),
            "b": _off_page(rng.integers(0, 9, 300_001, dtype=np.int64)),
            "h": _off_page(rng.standard_normal(123_457).astype(np.float16))}


def _bits_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and np.array_equal(np.asarray(a[k]).view(np.uint8), np.asarray(b[k]).view(np.uint8)) for k in a)


class WriteBackSpy:
    """Records ``(offset, nbytes)`` of every ``start_write_back`` call, then makes the real call."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self._real = posix.start_write_back

    def __call__(self, fd: int, offset: int, nbytes: int) -> None:
        self.ranges.append((offset, nbytes))
        self._real(fd, offset, nbytes)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> WriteBackSpy:
    recorder = WriteBackSpy()
    monkeypatch.setattr(posix, "start_write_back", recorder)
    return recorder


def test_a_file_written_from_the_state_memory_is_the_file_written_from_aligned_copies(tmp_path: Path) -> None:
    """The gaps after chunks written from the state's memory are holes; they read as the zeros the
    aligned copies hold, so both ways make the same bytes, and the file loads bit-exact."""
    state = _state()
    views = gdsckpt.save(state, tmp_path / "views.gdsckpt", codec="none", config=gdsckpt.Config(chunk_bytes=CHUNK))
    copies = gdsckpt.save(state, tmp_path / "copies.gdsckpt", codec="none",
                          config=gdsckpt.Config(chunk_bytes=CHUNK, o_direct=True)) \
        if _takes_o_direct(tmp_path) else None
    assert views.chunks >= 4
    if copies is not None:
        assert (tmp_path / "views.gdsckpt").read_bytes() == (tmp_path / "copies.gdsckpt").read_bytes()
    assert _bits_equal(gdsckpt.load(tmp_path / "views.gdsckpt"), state)
    gdsckpt.verify(tmp_path / "views.gdsckpt")  # raises on a bad checksum


def _takes_o_direct(directory: Path) -> bool:
    writer = PosixWriter(directory / "probe.gdsckpt", o_direct="auto")
    try:
        return "+odirect" in writer.name
    finally:
        writer.abort()


def test_chunks_stored_as_they_are_reach_the_writer_as_the_state_memory(tmp_path: Path) -> None:
    state = {"w": np.random.default_rng(3).standard_normal(3 * CHUNK // 4).astype(np.float32)}
    seen: list[bool] = []

    class Recording(MemoryWriter):
        def submit_write(self, offset: int, data: Any):  # type: ignore[no-untyped-def]
            if offset > 0 and isinstance(data, np.ndarray) and data.nbytes > 4096:
                seen.append(np.shares_memory(data, state["w"]))
            return super().submit_write(offset, data)

    store = MemoryStore()
    gdsckpt.save(state, Recording(store, "a"), codec="none", config=gdsckpt.Config(chunk_bytes=CHUNK))
    assert seen and all(seen)
    seen.clear()
    gdsckpt.save(state, Recording(store, "b"), codec="none", config=gdsckpt.Config(chunk_bytes=CHUNK, o_direct=True))
    assert seen and not any(seen)  # O_DIRECT asked for: aligned copies
    assert store.get("a") == store.get("b")


def test_bulk_buffered_writes_start_their_write_back_and_small_ones_do_not(tmp_path: Path, spy: WriteBackSpy) -> None:
    state = _state()
    report = gdsckpt.save(state, tmp_path / "a.gdsckpt", codec="none", config=gdsckpt.Config(chunk_bytes=CHUNK))
    assert posix.can_write_back() == bool(spy.ranges)
    if not spy.ranges:
        pytest.skip("no sync_file_range on this system: nothing is started early")
    assert all(nbytes >= WRITEBACK_MIN_BYTES for _, nbytes in spy.ranges)
    assert 0 not in {offset for offset, _ in spy.ranges}  # the header is left to fsync
    # every chunk of at least WRITEBACK_MIN_BYTES stored bytes had its range started
    with gdsckpt.open(tmp_path / "a.gdsckpt") as checkpoint:
        chunks = opened_file(checkpoint).index.chunks
    bulk = {(c.offset, c.stored) for c in chunks if c.stored >= WRITEBACK_MIN_BYTES}
    assert bulk and bulk <= set(spy.ranges)
    assert report.chunks == len(chunks)


def test_no_write_back_is_started_without_fsync(tmp_path: Path, spy: WriteBackSpy) -> None:
    gdsckpt.save(_state(), tmp_path / "a.gdsckpt", codec="none", config=gdsckpt.Config(chunk_bytes=CHUNK, fsync=False))
    assert spy.ranges == []
    assert _bits_equal(gdsckpt.load(tmp_path / "a.gdsckpt"), _state())


@pytest.mark.parametrize("o_direct", [False, "auto"])
@pytest.mark.parametrize("fsync", [True, False])
def test_the_writer_name_lists_each_way_it_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   o_direct: Any, fsync: bool) -> None:
    """``SaveReport.backend`` names both ways a save may use: ``+odirect`` where the O_DIRECT
    descriptor opened, ``+writeback`` where bulk buffered writes start their write-back (fsync on,
    and the host has ``sync_file_range``)."""
    monkeypatch.setattr(posix, "can_write_back", lambda: True)
    direct = o_direct == "auto" and _takes_o_direct(tmp_path)
    writer = PosixWriter(tmp_path / "named.gdsckpt", o_direct=o_direct, fsync=fsync)
    try:
        assert writer.name == "posix" + ("+odirect" if direct else "") + ("+writeback" if fsync else "")
    finally:
        writer.abort()
    monkeypatch.setattr(posix, "can_write_back", lambda: False)
    writer = PosixWriter(tmp_path / "named.gdsckpt", o_direct=o_direct, fsync=fsync)
    try:
        assert writer.name == "posix" + ("+odirect" if direct else "")
    finally:
        writer.abort()


def test_starting_write_back_reports_a_bad_descriptor_and_ignores_a_pipe(tmp_path: Path) -> None:
    if not posix.can_write_back():
        pytest.skip("no sync_file_range on this system")
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"x" * (2 << 20), 0)
        posix.start_write_back(fd, 0, 2 << 20)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as caught:
        posix.start_write_back(fd, 0, 4096)  # closed
    assert caught.value.errno == errno.EBADF
    read_end, write_end = os.pipe()
    try:
        posix.start_write_back(write_end, 0, 4096)  # ESPIPE: nothing to start, no error
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_failed_buffered_write_leaves_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the write-back of the third bulk write reports EIO. The save fails with that
    error, the previous checkpoint stays, and no temporary is left."""
    target = tmp_path / "a.gdsckpt"
    first = {"w": np.arange(10, dtype=np.float32)}
    gdsckpt.save(first, target)
    calls = []
    real = posix.start_write_back

    def failing(fd: int, offset: int, nbytes: int) -> None:
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(errno.EIO, "injected write-back error")
        real(fd, offset, nbytes)

    monkeypatch.setattr(posix, "can_write_back", lambda: True)
    monkeypatch.setattr(posix, "start_write_back", failing)
    with pytest.raises(OSError, match="injected write-back error"):
        gdsckpt.save(_state(), target, codec="none", config=gdsckpt.Config(chunk_bytes=CHUNK))
    assert len(calls) >= 3
    assert _bits_equal(gdsckpt.load(target), first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gdsckpt"]
