"""A replaced or pruned checkpoint's storage is freed off the caller's path (``gdsckpt.io.release``):
the name goes at once, the last descriptor is closed on the releaser's thread, at most
``MAX_PENDING`` wait, and nothing is left open once they are closed. Real files throughout; the
releaser's close is gated only to hold a release in flight."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import gdsckpt
from gdsckpt.io import release
from gdsckpt.io.release import MAX_PENDING, Releaser, remove_releasing


def _open_inodes() -> set[tuple[int, int]]:
    """(device, inode) of every file this process holds open."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            info = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        found.add((info.st_dev, info.st_ino))
    return found


def _identity(path: Path) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino


class GatedReleaser(Releaser):
    """A releaser whose thread waits for ``gate`` before each close (a release held in flight)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.closed_by: list[str] = []
        super().__init__(close=self._gated_close)

    def _gated_close(self, fd: int) -> None:
        name = threading.current_thread().name
        if name == "gdsckpt-release":
            assert self.gate.wait(30)
        self.closed_by.append(name)
        os.close(fd)


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> GatedReleaser:
    releaser = GatedReleaser()
    monkeypatch.setattr(release, "RELEASER", releaser)
    monkeypatch.setattr(release, "RELEASE_MIN_BYTES", 0)
    return releaser


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((1 << 16,), value), "b": torch.arange(10, dtype=torch.float64)}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_save_over_a_checkpoint_returns_before_the_old_file_is_freed(tmp_path: Path, gated: GatedReleaser) -> None:
    path = tmp_path / "x.gdsckpt"
    gdsckpt.save(_state(1.0), path)
    old = _identity(path)
    gdsckpt.save(_state(2.0), path)
    # the path names the new checkpoint at once, while the old file is still held for release
    assert _identity(path) != old and gdsckpt.load(path)["w"][0].item() == 2.0
    assert old in _open_inodes() and gated.pending() == 1
    gated.gate.set()
    assert gated.wait(30)
    assert old not in _open_inodes() and gated.closed_by == ["gdsckpt-release"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_at_most_max_pending_wait_and_the_caller_closes_the_next(tmp_path: Path, gated: GatedReleaser) -> None:
    files = []
    for i in range(MAX_PENDING + 2):
        path = tmp_path / f"{i}.bin"
        path.write_bytes(b"x" * 4096)
        files.append(_identity(path))
        remove_releasing(path)
        assert not path.exists()
    assert gated.pending() == MAX_PENDING
    # the two beyond the bound were closed in this thread: their storage is already gone
    assert gated.closed_by == [threading.current_thread().name] * 2
    assert not set(files[MAX_PENDING:]) & _open_inodes()
    gated.gate.set()
    assert gated.wait(30)
    assert not set(files) & _open_inodes()


def test_what_is_not_held(tmp_path: Path) -> None:
    releaser = Releaser()
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * 8192)
    assert releaser.hold(tmp_path / "missing") is None
    assert releaser.hold(big, min_bytes=8193) is None  # too small to be worth it
    link = tmp_path / "link"
    link.symlink_to(big)
    assert releaser.hold(link, min_bytes=0) is None  # renaming over a symlink frees nothing
    hard = tmp_path / "hard"
    os.link(big, hard)
    assert releaser.hold(big, min_bytes=0) is None  # its storage stays with the other name
    hard.unlink()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert releaser.hold(fifo, min_bytes=0) is None  # opened without blocking, then refused
    assert releaser.hold(tmp_path, min_bytes=0) is None
    fd = releaser.hold(big, min_bytes=0)
    assert fd is not None
    releaser.release(fd)
    assert releaser.wait(30) and releaser.pending() == 0
    with pytest.raises(OSError):
        os.fstat(fd)  # closed


def test_removing_a_missing_file_raises_and_holds_nothing(tmp_path: Path) -> None:
    releaser = Releaser()
    with pytest.raises(FileNotFoundError):
        remove_releasing(tmp_path / "missing", releaser)
    assert releaser.pending() == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_the_manager_prunes_through_the_releaser(tmp_path: Path, gated: GatedReleaser) -> None:
    manager = gdsckpt.CheckpointManager(tmp_path / "run", keep_last=1)
    manager.save(1, _state(1.0))
    first = _identity(next((tmp_path / "run").glob("*1*.gdsckpt")))
    manager.save(2, _state(2.0))
    assert first in _open_inodes() and gated.pending() >= 1  # pruned, its storage not yet freed
    gated.gate.set()
    assert gated.wait(30) and first not in _open_inodes()
    step, restored = manager.restore_latest()
    assert step == 2 and restored["w"][0].item() == 2.0


def test_a_forked_child_starts_afresh(tmp_path: Path) -> None:
    releaser = Releaser()
    path = tmp_path / "x.bin"
    path.write_bytes(b"x")
    fd = releaser.hold(path, min_bytes=0)
    assert fd is not None
    releaser._queue.append(fd)  # as a fork would find one queued
    releaser._pending = 1
    releaser.after_fork_in_child()
    assert releaser.pending() == 0 and releaser.wait(0)
    with pytest.raises(OSError):
        os.fstat(fd)
