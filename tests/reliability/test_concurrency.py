"""Concurrent processes on one checkpoint path.

Two processes save different states to one path at the same moment, again and again: each time
the path ends up holding exactly one of the two complete checkpoints, bit-exact (the rename is
atomic and each writer has its own temporary file, which the other never removes while its
writer lives). A reader process loads the path in a loop while another process saves new versions
over it: every load returns one complete version, bit-exact, never older than the one before, and
never fails (a reader keeps the file it opened, whatever is renamed over the path meanwhile).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import gdsckpt
from gdsckpt.io import posix
from gdsckpt.io.posix import TEMP_MARKER

from .harness import Child, record_figure
from .worker import CONCURRENT_ELEMENTS, READER_ELEMENTS, config, state_for

ROUNDS = 12
VERSIONS = 40  # saved one after another while the reader loads


def test_two_writers_at_once_leave_one_complete_checkpoint(tmp_path: Path, h: Any) -> None:
    target = tmp_path / "ckpt" / "state.gdsckpt"
    target.parent.mkdir()
    env = h.subprocess_env()
    writers = [Child(env, tmp_path / f"writer-{i}.err", "concurrent", str(target), str(i)) for i in (0, 1)]
    winners: Counter[str] = Counter()
    overlapped = 0
    try:
        for writer in writers:
            writer.expect("ready")
        for round_ in range(ROUNDS):
            for writer in writers:
                writer.send(f"go {round_}")
            done = [writer.expect("done", timeout=120) for writer in writers]
            overlapped += max(d["started"] for d in done) < min(d["ended"] for d in done)
            gdsckpt.verify(target, config=config())
            loaded = gdsckpt.load(target, config=config())
            version = loaded["meta"]["version"]
            assert version in {2 * round_, 2 * round_ + 1}, (round_, version)
            h.assert_same(state_for(version, CONCURRENT_ELEMENTS), loaded)
            last = max(done, key=lambda d: d["ended"])["version"]
            winners["the writer that finished last" if version == last
                    else "the writer that finished first"] += 1
            assert [p.name for p in target.parent.iterdir()] == [target.name], "a temporary file was left"
    finally:
        for writer in writers:
            writer.close()
    assert overlapped >= ROUNDS // 2, f"only {overlapped} of {ROUNDS} rounds ran the two saves at once"
    record_figure("two writers on one path", (
        f"{ROUNDS} rounds ({overlapped} with both saves running at once): {ROUNDS} times exactly one of the "
        f"two complete checkpoints, bit-exact, 0 interleaved; the path held "
        + ", ".join(f"{n}x {who}" for who, n in sorted(winners.items()))))


def test_reader_during_saves_sees_only_complete_versions(tmp_path: Path, h: Any) -> None:
    target = tmp_path / "state.gdsckpt"
    gdsckpt.save(state_for(0, READER_ELEMENTS), target, config=config())
    env = h.subprocess_env()
    reader = Child(env, tmp_path / "reader.err", "reader", str(target))
    writer = Child(env, tmp_path / "writer.err", "versions", str(target), "1", str(VERSIONS))
    try:
        reader.expect("ready")
        writer.expect("ready")
        reader.send("go")
        writer.send("go")
        writer.expect("done", timeout=300)
        reader.send("stop")
        summary = reader.expect("summary", timeout=120)
    finally:
        writer.close()
        reader.close()
    assert summary["error_count"] == 0, "\n".join(summary["errors"])
    assert summary["loads"] >= 15 and len(summary["versions"]) >= 3, summary
    assert summary["raced"] >= 1, f"no load overlapped a rename: {summary}"
    assert not any(TEMP_MARKER in p.name for p in tmp_path.iterdir())
    h.assert_same(state_for(VERSIONS, READER_ELEMENTS), gdsckpt.load(target))
    record_figure("reader during saves", (
        f"{summary['loads']} loads ({summary['lazy']} through open().get_many) while {VERSIONS} versions "
        f"were saved over the path: {summary['loads']} complete versions bit-exact, never older than the one "
        f"before, 0 errors; {summary['raced']} loads had the path replaced while they ran; "
        f"{len(summary['versions'])} distinct versions seen"))


def test_a_tensor_changed_while_it_is_written_fails_the_save_and_keeps_the_previous_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks stored as they are (``codec="none"``, what ``auto`` picks where compressing cannot
    keep up) are written from the tensor's own memory after their checksum is taken. A training
    step in another thread between the two (injected here at the write) made a file every load
    refuses, and the save returned success: a manager then pruned the checkpoint it replaced,
    leaving none to restore. The save now fails, and nothing on disk changes."""
    w = torch.zeros(1 << 20)
    original = posix.PosixWriter.submit_write

    def submit_write_after_a_step(self: Any, offset: int, data: Any) -> Any:
        if offset > 0 and not isinstance(data, bytes):  # a chunk (the header and the tail are bytes)
            w.add_(1)  # fault injection: another thread's optimizer step, mid-save
        return original(self, offset, data)

    path = tmp_path / "c.gdsckpt"
    gdsckpt.save({"w": torch.full((1 << 20,), -1.0)}, path, codec="none")
    before = path.read_bytes()
    manager = gdsckpt.CheckpointManager(tmp_path / "run", keep_last=1)
    manager.save(1, {"w": torch.full((1 << 20,), -1.0)}, codec="none")
    monkeypatch.setattr(posix.PosixWriter, "submit_write", submit_write_after_a_step)
    with pytest.raises(gdsckpt.StateChangedError, match="'w' changed while it was saved"):
        gdsckpt.save({"w": w}, path, codec="none")
    assert path.read_bytes() == before
    with pytest.raises(gdsckpt.StateChangedError):
        manager.save(2, {"w": w}, codec="none")
    monkeypatch.undo()
    restored = manager.restore_latest()
    assert restored is not None and restored[0] == 1 and torch.equal(restored[1]["w"], torch.full((1 << 20,), -1.0))
