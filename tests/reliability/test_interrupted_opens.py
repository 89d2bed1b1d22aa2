"""A ^C (or any error) between opening a file and handing it to its owner, and a checkpoint
dropped without ``close``: no temporary file and no descriptor outlives them.

Found by interrupting saves, loads and manager saves at random points (``_thread.interrupt_main``):
about one in a hundred left a save's temporary file and its descriptor for the life of the
process (later saves never remove a live process's temporary), or a reader's descriptor. One
window stays: a ^C the instant ``os.open`` returns, before its result is stored (CPython checks
for signals as the call returns), loses that one descriptor; the temporary is still removed, by
its name.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gdsckpt
from gdsckpt.io import posix


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _temporaries(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if "gdsckpt-tmp" in name)


def _state(seed: int) -> dict[str, Any]:
    return {"w": np.random.default_rng(seed).standard_normal(50_000).astype(np.float32)}


def _interrupt(*_args: Any, **_kwargs: Any) -> Any:
    raise KeyboardInterrupt


def test_a_save_interrupted_once_its_temporary_is_open_leaves_neither(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.gdsckpt"
    old = _state(1)
    gdsckpt.save(old, path)
    before = _descriptors()
    with monkeypatch.context() as patch:
        patch.setattr(posix, "can_write_back", _interrupt)  # the first call after the temporary's open
        with pytest.raises(KeyboardInterrupt):
            gdsckpt.save(_state(2), path)
    assert _temporaries(tmp_path) == [] and _descriptors() == before
    assert gdsckpt.load(path)["w"].tobytes() == old["w"].tobytes()
    gdsckpt.save(_state(3), path)  # and the next save works
    assert gdsckpt.load(path)["w"].tobytes() == _state(3)["w"].tobytes()


def test_a_small_file_write_interrupted_as_its_temporary_opens_leaves_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager's ``latest`` pointer (``write_atomically``): the ^C in the window as os.open
    returns; the descriptor is lost there, the temporary is not."""
    target = tmp_path / "latest"
    target.write_bytes(b"old")
    real_open = os.open
    lost: list[int] = []

    class InterruptedOpen:
        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

        def open(self, path: Any, flags: int, *args: Any) -> int:
            lost.append(real_open(path, flags, *args))
            raise KeyboardInterrupt

    monkeypatch.setattr(posix, "os", InterruptedOpen())
    try:
        with pytest.raises(KeyboardInterrupt):
            posix.write_atomically(target, b"new", fsync=True)
    finally:
        monkeypatch.undo()
        for fd in lost:
            os.close(fd)
    assert _temporaries(tmp_path) == [] and target.read_bytes() == b"old"


def test_an_abort_interrupted_while_it_waits_for_writes_still_removes_the_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ^C while ``abort`` waits for the writes in flight (a save worker stops its save so when
    its training process dies, and the save may be aborting already) skipped the removal of the
    temporary, and the second abort the interrupt leads to returned at once: the temporary stayed
    until the next save to that path."""
    writer = posix.PosixWriter(tmp_path / "a.gdsckpt")
    temporary, close = writer.temp, writer._lane.close

    def interrupted(timeout: float) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(writer._lane, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        writer.abort()
    assert not temporary.exists()
    writer.abort()  # once is enough
    assert close(10.0)
    writer._close_fds()


def test_a_reader_interrupted_before_it_exists_closes_its_file(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.gdsckpt"
    gdsckpt.save(_state(1), path)
    before = _descriptors()
    with monkeypatch.context() as patch:
        patch.setattr(posix, "Lane", _interrupt)  # made after the file is open
        with pytest.raises(KeyboardInterrupt):
            gdsckpt.open(path)
    assert _descriptors() == before


def test_a_checkpoint_dropped_without_close_closes_its_files_with_a_resource_warning(tmp_path: Path) -> None:
    """``gdsckpt.open(p).get(k)`` kept the file (and a delta's base) open for the life of the
    process: 100 such reads of full files and 100 of deltas held 300 descriptors, and the disk
    space of the files deleted since."""
    base, delta = tmp_path / "base.gdsckpt", tmp_path / "delta.gdsckpt"
    state = _state(1)
    gdsckpt.save(state, base)
    state["w"][:10] += 1
    gdsckpt.save(state, delta, base=base)
    gc.collect()  # what earlier tests left for the collector closes its files now, not below
    before = _descriptors()
    with pytest.warns(ResourceWarning, match="never closed"):
        for _ in range(5):
            assert gdsckpt.open(delta).get("w").tobytes() == state["w"].tobytes()
            gc.collect()
    assert _descriptors() == before
    with gdsckpt.open(delta) as checkpoint:  # closed: no warning (warnings are errors here)
        checkpoint.get("w")
    del checkpoint
    gc.collect()
    assert _descriptors() == before


def test_a_checkpoint_collected_on_its_own_readers_worker_thread_is_closed_without_waiting(tmp_path: Path) -> None:
    """The garbage collector runs wherever memory is allocated: a dropped checkpoint collected
    on an I/O worker thread closed its reader there, which waits for the reader's tasks, the
    running one among them, until ``Config.timeout``."""
    path = tmp_path / "c.gdsckpt"
    gdsckpt.save(_state(1), path)
    checkpoint = gdsckpt.open(path, config=gdsckpt.Config(timeout=30))
    lane = checkpoint._reader._lane
    with pytest.warns(ResourceWarning, match="never closed"):
        assert lane.submit(checkpoint._finalizer).result(timeout=10) is None  # as gc on that worker would
    deadline = time.monotonic() + 10
    while checkpoint._reader._fd >= 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert checkpoint._reader._fd < 0  # closed, off the worker
