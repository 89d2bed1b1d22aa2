"""Special files: nothing a reader opens may stall it or make it read without end.

A FIFO named like a checkpoint (or as ``latest``) used to hang ``restore_latest``, the prune
after a save, ``load`` and ``inspect`` in ``open()``, waiting for a writer that never comes;
``latest`` symlinked to ``/dev/zero`` or to a huge file was read whole. Now every reader opens
without blocking and only regular files (``io.posix.open_regular``), the manager's scan passes
over anything else named like a checkpoint, and ``latest`` is read with a size cap.

Each call runs on a daemon thread with a bound, so a regression fails the test instead of hanging
the suite.
"""

from __future__ import annotations

import os
import threading
import time
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gdsckpt
from gdsckpt.cli.main import main as cli_main
from gdsckpt.errors import CheckpointError, UnsupportedFormatError
from gdsckpt.manager import MAX_POINTER_BYTES, SkippedCheckpointWarning

from .harness import record_figure

BOUND = 30.0  # seconds; each call takes milliseconds, a hang is what this bounds


def _bounded(call: Callable[[], Any], bound: float = BOUND) -> tuple[Any, float]:
    """(what ``call()`` returned, seconds it took); fails the test if it runs past ``bound`` s.
    An exception ``call`` raised is raised here."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as err:
            outcome["error"] = err

    started = time.perf_counter()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound)
    if thread.is_alive():
        pytest.fail(f"still running after {bound} s (blocked on a special file?)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value"), time.perf_counter() - started


def _state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(10_000).astype(np.float32), "step": step}


def _manager(directory: Path, **kwargs: Any) -> gdsckpt.CheckpointManager:
    return gdsckpt.CheckpointManager(directory, config=gdsckpt.Config(fsync=False, timeout=60), **kwargs)


def _saved(directory: Path, steps: list[int], **kwargs: Any) -> gdsckpt.CheckpointManager:
    manager = _manager(directory, **kwargs)
    for step in steps:
        manager.save(step, _state(step))
    return manager


def _restored_step(manager: gdsckpt.CheckpointManager) -> tuple[int, list[str], float]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, seconds = _bounded(manager.restore_latest)
    assert result is not None
    step, extra = result
    assert extra["w"].tobytes() == _state(step)["w"].tobytes()
    return step, [str(w.message) for w in caught if issubclass(w.category, SkippedCheckpointWarning)], seconds


def test_fifo_named_like_the_newest_checkpoint_is_passed_over(tmp_path: Path) -> None:
    manager = _saved(tmp_path, [1, 2], keep_last=None)
    os.mkfifo(manager.path(3))
    step, _warned, seconds = _restored_step(_manager(tmp_path, keep_last=None))
    assert step == 2
    assert _bounded(manager.steps)[0] == [1, 2]
    assert _bounded(manager.latest_step)[0] == 2
    record_figure("FIFO named like the newest checkpoint",
                  f"restore_latest returned step 2 in {seconds * 1000:.0f} ms (before: blocked until killed)")


def test_fifo_as_latest_is_ignored_with_a_warning(tmp_path: Path) -> None:
    _saved(tmp_path, [1, 2], keep_last=None)
    (tmp_path / "latest").unlink()
    os.mkfifo(tmp_path / "latest")
    step, warned, _ = _restored_step(_manager(tmp_path, keep_last=None))
    assert step == 2
    assert any("FIFO" in text and "latest" in text for text in warned), warned


def test_prune_after_a_save_leaves_a_fifo_alone(tmp_path: Path) -> None:
    manager = _manager(tmp_path, keep_last=1)
    os.mkfifo(manager.path(0))
    for step in (1, 2, 3):
        _bounded(lambda step=step: manager.save(step, _state(step)))
    assert os.path.exists(manager.path(0)) and not manager.path(0).is_file()  # not ours to remove
    assert sorted(p.name for p in tmp_path.glob("*.gdsckpt") if p.is_file()) == [manager.path(3).name]


def test_save_async_prune_leaves_a_fifo_alone(tmp_path: Path) -> None:
    manager = _manager(tmp_path, keep_last=1)
    os.mkfifo(manager.path(5))
    handle = manager.save_async(1, _state(1))
    _bounded(lambda: handle.wait(timeout=BOUND))
    _bounded(lambda: manager.wait(timeout=BOUND))
    assert _restored_step(_manager(tmp_path))[0] == 1


@pytest.mark.parametrize("entry", ["fifo", "directory", "dev-null-link", "dev-zero-link"])
def test_load_open_verify_refuse_what_is_not_a_regular_file(tmp_path: Path, entry: str) -> None:
    path = tmp_path / "x.gdsckpt"
    if entry == "fifo":
        os.mkfifo(path)
    elif entry == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/null" if entry == "dev-null-link" else "/dev/zero")
    for call in (lambda: gdsckpt.load(path), lambda: gdsckpt.open(path), lambda: gdsckpt.verify(path),
                 lambda: gdsckpt.inspect(path)):
        with pytest.raises(UnsupportedFormatError, match="not a regular file"):
            _bounded(call)


def test_cli_inspect_and_verify_of_a_fifo_give_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "x.gdsckpt"
    os.mkfifo(fifo)
    for command in ("inspect", "verify"):
        code, _ = _bounded(lambda command=command: cli_main([command, str(fifo)]))
        err = capsys.readouterr().err
        assert code != 0
        assert "not a regular file" in err and "Traceback" not in err, err


@pytest.mark.parametrize("target", ["/dev/zero", "huge"])
def test_latest_pointing_at_an_endless_or_huge_file_is_not_read_whole(tmp_path: Path, target: str) -> None:
    _saved(tmp_path, [1, 2], keep_last=None)
    (tmp_path / "latest").unlink()
    if target == "huge":
        huge = tmp_path / "huge"
        with huge.open("wb") as handle:  # sparse: 1 GiB that takes no space
            handle.truncate(1 << 30)
        target = str(huge)
    (tmp_path / "latest").symlink_to(target)
    tracemalloc.start()
    try:
        step, warned, seconds = _restored_step(_manager(tmp_path, keep_last=None))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert step == 2
    assert any("latest" in text for text in warned), warned
    assert peak < 64 << 20  # the pointer was not read whole (a 1 GiB read alone would be 1 GiB)
    record_figure(f"latest -> {Path(target).name}",
                  f"ignored with a warning, step 2 restored in {seconds * 1000:.0f} ms, Python peak "
                  f"{peak / 2**20:.1f} MiB (pointer cap {MAX_POINTER_BYTES} B; before: MemoryError)")


def test_checkpoint_symlinked_to_a_device_is_not_a_candidate(tmp_path: Path) -> None:
    manager = _saved(tmp_path, [1], keep_last=None)
    manager.path(9).symlink_to("/dev/zero")
    step, _warned, _ = _restored_step(_manager(tmp_path, keep_last=None))
    assert step == 1


def test_convert_from_a_fifo_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "in.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="not a regular file"):
        _bounded(lambda: gdsckpt.convert(fifo, tmp_path / "out.gdsckpt"))
    assert not (tmp_path / "out.gdsckpt").exists()


def test_dcp_reader_refuses_a_fifo_as_its_metadata(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from gdsckpt.dcp import GdsStorageReader, GdsStorageWriter

    with pytest.warns(UserWarning, match="torch.distributed is disabled"):  # one process, no group
        dcp.save({"w": torch.arange(64, dtype=torch.float32)},
                 storage_writer=GdsStorageWriter(tmp_path, config=gdsckpt.Config(fsync=False)))
    json_path = tmp_path / ".metadata.json"
    json_path.unlink()
    os.mkfifo(json_path)
    with pytest.raises(CheckpointError, match="not a regular file"):
        _bounded(lambda: GdsStorageReader(tmp_path).read_metadata())


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_a_save_or_conversion_never_replaces_what_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    """``gdsckpt convert a.gdsckpt /dev/null --to pt --overwrite`` run as root replaced the device
    with a regular file, and a save renamed its file over a FIFO. A save, a conversion with
    ``overwrite=True`` (to each format) and the save worker's publish step now refuse a FIFO, a
    socket or a device at the destination with ``FileExistsError``, before writing anything, and
    leave it as it was."""
    import socket
    import stat

    source = tmp_path / "source.gdsckpt"
    gdsckpt.save({"w": np.arange(64, dtype=np.float32)}, source)
    special = tmp_path / "special"
    held = None
    if kind == "fifo":
        os.mkfifo(special)
    else:
        held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        held.bind(str(special))
    try:
        def still_special() -> bool:
            mode = os.lstat(special).st_mode
            return stat.S_ISFIFO(mode) if kind == "fifo" else stat.S_ISSOCK(mode)

        with pytest.raises(FileExistsError, match="not a regular file"):
            _bounded(lambda: gdsckpt.save({"w": np.zeros(4, dtype=np.float32)}, special))
        assert still_special()
        for dst_format in ("gdsckpt", "pt", "safetensors"):
            with pytest.raises(FileExistsError, match="not a regular file"):
                _bounded(lambda fmt=dst_format: gdsckpt.convert(source, special, dst_format=fmt, overwrite=True))
            assert still_special(), dst_format
        from gdsckpt.io.posix import publish

        temp = tmp_path / "finished"
        temp.write_bytes(b"a finished file")
        with pytest.raises(FileExistsError, match="not a regular file"):
            publish(temp, special, fsync=False)
        assert still_special() and not temp.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["source.gdsckpt", "special"]
    finally:
        if held is not None:
            held.close()


def test_a_save_or_conversion_to_a_symlink_to_a_device_fifo_or_descriptor_is_refused(tmp_path: Path) -> None:
    """A save to a symlink replaces the link as it is; one to ``/dev/null`` or to a FIFO replaced
    the link with a regular file, and ``convert x.pt /dev/stdout`` (a link through /proc/self/fd)
    replaced the system's ``/dev/stdout`` when run as root. Refused now, the links left as they
    were; a link to a regular file is still replaced by the new checkpoint."""
    state = _state(1)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    descriptor = tmp_path / "stdout"
    descriptor.symlink_to("/proc/self/fd/1")
    for target in (os.devnull, fifo, descriptor):
        link = tmp_path / f"link-to-{Path(target).name}.gdsckpt"
        if target is descriptor:
            link = descriptor
        else:
            link.symlink_to(target)
        with pytest.raises(FileExistsError, match="does not replace it"):
            gdsckpt.save(state, link)
        assert link.is_symlink(), link
    relative = tmp_path / "relative.gdsckpt"  # a relative link, saved to by a relative path
    relative.symlink_to(os.path.relpath("/proc/self/fd/1", tmp_path))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(FileExistsError, match="open file descriptor"):
            gdsckpt.save(state, "relative.gdsckpt")
    finally:
        os.chdir(cwd)
    assert relative.is_symlink()
    source = tmp_path / "a.gdsckpt"
    gdsckpt.save(state, source)
    assert cli_main(["convert", str(source), str(tmp_path / "link-to-null.gdsckpt"), "--to", "safetensors",
                     "--overwrite"]) == 1
    assert (tmp_path / "link-to-null.gdsckpt").is_symlink()
    regular = tmp_path / "regular.gdsckpt"
    regular.write_bytes(b"old")
    replaced = tmp_path / "link-to-regular.gdsckpt"
    replaced.symlink_to(regular)
    gdsckpt.save(state, replaced)
    assert not replaced.is_symlink() and regular.read_bytes() == b"old"
    assert np.array_equal(gdsckpt.load(replaced)["w"], state["w"])
