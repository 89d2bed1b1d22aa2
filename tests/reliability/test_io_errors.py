"""Disk full and I/O errors, injected at the OS calls gdsckpt's POSIX backend makes.

Saving: ENOSPC and EIO at every stage of a save (creating the temporary file, writing a chunk,
writing the index and trailer, truncating to length, fsync of the file, the rename, fsync of the
directory) raise an ``OSError`` with that errno, leave the target's bytes as they were (except the
directory fsync, which comes after the rename: see its test) and remove the temporary file; the
same for the ``latest`` pointer of a ``CheckpointManager``. ``tests/test_atomic.py`` already
covers ENOSPC from ``os.pwrite`` at the header, early chunks, the middle and the tail, EIO from
``os.fsync``/``os.replace``/``os.ftruncate``, encode and source-read failures; the cases here are
the stages and errnos it lacks, plus short and zero-byte writes.

Loading: EIO reading a chunk, EIO reading the index, a file truncated while it is being loaded
and short reads: a ``CheckpointError`` naming the chunk and the tensor (or an ``OSError`` with its
errno, for the index), no state returned; short reads load bit-exact; ``restore_latest`` raises
the error for a checkpoint with an unreadable chunk (an I/O error is no proof of damage: the next
read may succeed) and restores nothing older.

Faults replace ``os.<function>`` (``gdsckpt.io.posix`` and ``gdsckpt.manager`` call the ``os``
module) with a wrapper that fails only the calls a predicate selects; every other call runs.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import gdsckpt
from gdsckpt import CheckpointManager
from gdsckpt.format.layout import TRAILER_MAGIC, unpack_trailer
from gdsckpt.io import posix
from gdsckpt.io.posix import TEMP_MARKER
from gdsckpt.pipeline.load import chunk_owner

from .harness import record_figure
from .worker import state_for

ELEMENTS = 20_000  # with 4 KiB chunks: 31 chunks
CODES = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO}


@pytest.fixture(autouse=True)
def one_pwrite_per_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests aim faults at single ``os.pwrite`` calls: no O_DIRECT writes are joined into
    one ``pwritev`` here (``tests/reliability/test_coalesced_writes.py`` covers joined writes)."""
    monkeypatch.setattr(posix, "COALESCE_BYTES", 0)


class Fault:
    """Replaces ``os.<name>``: calls that ``matches(*args)`` selects fail with ``OSError(code)``
    from the ``after``-th of them on (a disk that stays full or a sector that stays bad); all
    other calls run the real function."""

    def __init__(self, name: str, matches: Callable[..., bool], code: int, after: int = 0):
        self.name, self.matches, self.code, self.after = name, matches, code, after
        self.original = getattr(os, name)
        self.selected = self.raised = 0
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.matches(*args):
            with self._lock:
                number = self.selected
                self.selected += 1
            if number >= self.after:
                self.raised += 1
                raise OSError(self.code, f"{os.strerror(self.code)} (injected into os.{self.name})")
        return self.original(*args, **kwargs)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> Fault:
        monkeypatch.setattr(os, self.name, self)
        return self


def _is_directory(fd: int) -> bool:
    return stat.S_ISDIR(os.fstat(fd).st_mode)


def _is_tail(data: Any) -> bool:
    view = memoryview(data).cast("B")
    return len(view) >= 64 and bytes(view[-64:-56]) == TRAILER_MAGIC


def _is_o_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))


def _temporary(path: Any) -> bool:
    return TEMP_MARKER in os.fspath(path)


# Stage -> (os function, which of its calls fail, from the how-manieth selected call on).
SAVE_STAGES: dict[str, tuple[str, Callable[..., bool], int]] = {
    "create temporary file": ("open", lambda path, flags, *a: _temporary(path) and bool(flags & os.O_CREAT),
                              0),
    "chunk write": ("pwrite", lambda fd, data, offset: offset > 0 and not _is_tail(data), 3),
    "index and trailer write": ("pwrite", lambda fd, data, offset: _is_tail(data), 0),
    "truncate to length": ("ftruncate", lambda fd, length: True, 0),
    "fsync of the file": ("fsync", lambda fd: not _is_directory(fd), 0),
    "rename over the target": ("replace", lambda src, dst, *a: _temporary(src), 0),
}
# (stage, errno) pairs tests/test_atomic.py covers already (pwrite ENOSPC at every phase, EIO
# from ftruncate / fsync / replace).
COVERED_BY_TEST_ATOMIC = {("chunk write", "ENOSPC"), ("index and trailer write", "ENOSPC"),
                          ("truncate to length", "EIO"), ("fsync of the file", "EIO"),
                          ("rename over the target", "EIO")}
SAVE_CASES = [(stage, code) for stage in SAVE_STAGES for code in CODES
              if (stage, code) not in COVERED_BY_TEST_ATOMIC]


@pytest.fixture
def config(h: Any) -> gdsckpt.Config:
    return h.small_config(fsync=True, io_threads=2)  # 4 KiB chunks, real fsync, O_DIRECT where it works


@pytest.fixture
def previous(ckpt_path: Path, config: gdsckpt.Config) -> bytes:
    """The target's content before the failing save."""
    gdsckpt.save(state_for(1, ELEMENTS), ckpt_path, config=config)
    return ckpt_path.read_bytes()


def _names_beside(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


@pytest.mark.parametrize(("stage", "code"), SAVE_CASES)
def test_save_error_keeps_the_target_and_removes_the_temporary(
        stage: str, code: str, ckpt_path: Path, previous: bytes, config: gdsckpt.Config,
        monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    name, matches, after = SAVE_STAGES[stage]
    with monkeypatch.context() as m:
        fault = Fault(name, matches, CODES[code], after).install(m)
        with pytest.raises(OSError) as caught:
            gdsckpt.save(state_for(2, ELEMENTS), ckpt_path, config=config)
    assert fault.raised >= 1, f"the fault at {stage} never fired: the save does not call os.{name} there"
    assert caught.value.errno == CODES[code], caught.value
    assert "injected" in str(caught.value)
    assert ckpt_path.read_bytes() == previous
    assert _names_beside(ckpt_path) == [ckpt_path.name], "a temporary file was left behind"
    gdsckpt.save(state_for(2, ELEMENTS), ckpt_path, config=config)  # the disk has room again
    h.assert_same(state_for(2, ELEMENTS), gdsckpt.load(ckpt_path))
    record_figure(f"save error: {code} at {stage}", "OSError with errno raised, target bytes unchanged, "
                                                    "temporary removed")


@pytest.mark.parametrize("code", CODES)
def test_directory_fsync_error_is_raised_after_the_new_checkpoint_is_in_place(
        code: str, ckpt_path: Path, previous: bytes, config: gdsckpt.Config, monkeypatch: pytest.MonkeyPatch,
        h: Any) -> None:
    """The directory fsync makes the rename durable, so it runs after the rename: when it fails the
    path already holds the new, complete checkpoint (the previous file is gone and cannot be put
    back). The error is raised all the same, because the rename may not survive a power loss."""
    with monkeypatch.context() as m:
        fault = Fault("fsync", _is_directory, CODES[code]).install(m)
        with pytest.raises(OSError) as caught:
            gdsckpt.save(state_for(2, ELEMENTS), ckpt_path, config=config)
    assert fault.raised == 1 and caught.value.errno == CODES[code]
    assert ckpt_path.read_bytes() != previous
    gdsckpt.verify(ckpt_path)
    h.assert_same(state_for(2, ELEMENTS), gdsckpt.load(ckpt_path))
    assert _names_beside(ckpt_path) == [ckpt_path.name]
    record_figure(f"save error: {code} at fsync of the directory",
                  "OSError with errno raised; the path holds the new complete checkpoint (renamed before)")


def test_zero_byte_write_is_an_eio(ckpt_path: Path, previous: bytes, config: gdsckpt.Config,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``os.pwrite`` returning 0 (no progress, no errno) fails the save instead of looping."""
    original = os.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        return 0 if offset > 0 else original(fd, data, offset)  # the header lands, nothing after it

    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", pwrite)
        with pytest.raises(OSError) as caught:
            gdsckpt.save(state_for(2, ELEMENTS), ckpt_path, config=config)
    assert caught.value.errno == errno.EIO and "wrote nothing" in str(caught.value)
    assert ckpt_path.read_bytes() == previous
    assert _names_beside(ckpt_path) == [ckpt_path.name]


def test_short_writes_and_refused_o_direct_writes_save_bit_exact(
        ckpt_path: Path, config: gdsckpt.Config, monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    """Every ``os.pwrite`` writes at most half its bytes, and O_DIRECT writes are refused with
    EINVAL (a filesystem that takes O_DIRECT at open but not for this write): the save completes,
    bit-exact."""
    original = os.pwrite
    counts = {"short": 0, "o_direct refused": 0}

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if _is_o_direct(fd):
            counts["o_direct refused"] += 1
            raise OSError(errno.EINVAL, "injected: O_DIRECT write refused")
        view = memoryview(data).cast("B")
        if len(view) > 1:
            counts["short"] += 1
            view = view[:len(view) // 2]
        return original(fd, view, offset)

    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", pwrite)
        gdsckpt.save(state_for(2, ELEMENTS), ckpt_path, config=config)
    assert counts["short"] > 100 and counts["o_direct refused"] > 0, counts
    gdsckpt.verify(ckpt_path)
    h.assert_same(state_for(2, ELEMENTS), gdsckpt.load(ckpt_path))
    record_figure("short and refused writes", f"{counts['short']} half-length pwrites and "
                  f"{counts['o_direct refused']} refused O_DIRECT writes: the file is complete and bit-exact")


# ---------------------------------------------------------------------------------------------
# the manager's ``latest`` pointer

POINTER_STAGES = {
    # manager.save fsyncs the checkpoint's temporary first, then the pointer's
    "fsync of the pointer": ("fsync", lambda fd: not _is_directory(fd), 1),
    "rename of the pointer": ("replace", lambda src, dst, *a: Path(src).name.startswith(".latest"), 0),
}


@pytest.mark.parametrize("stage", POINTER_STAGES)
def test_pointer_update_error_keeps_latest_and_restore_finds_the_new_step(
        stage: str, tmp_path: Path, config: gdsckpt.Config, monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2, config=config)
    manager.save(1, state_for(1, ELEMENTS))
    name, matches, after = POINTER_STAGES[stage]
    with monkeypatch.context() as m:
        fault = Fault(name, matches, errno.ENOSPC, after).install(m)
        with pytest.raises(OSError) as caught:
            manager.save(2, state_for(2, ELEMENTS))
    assert fault.raised == 1 and caught.value.errno == errno.ENOSPC
    assert (tmp_path / "latest").read_text() == "step-0000000001.gdsckpt\n"
    assert _names_beside(tmp_path / "latest") == ["latest", "step-0000000001.gdsckpt",
                                                      "step-0000000002.gdsckpt"]
    # A restart finds step 2: complete, and written after ``latest`` was.
    restarted = CheckpointManager(tmp_path, keep_last=2, config=config)
    step, everything = restarted.restore_latest()  # type: ignore[misc]
    assert step == 2
    h.assert_same(state_for(2, ELEMENTS), everything)
    record_figure(f"manager: ENOSPC at {stage}", "OSError raised, latest unchanged, no temporary left, "
                                                 "restore_latest returns the new complete step")


# ---------------------------------------------------------------------------------------------
# loading

@pytest.fixture
def saved(ckpt_path: Path, config: gdsckpt.Config, h: Any) -> Any:
    """A checkpoint of ``state_for(3)`` at ``ckpt_path``; returns its index."""
    gdsckpt.save(state_for(3, ELEMENTS), ckpt_path, config=config)
    return h.read_index(ckpt_path)


def _get_all(path: Path) -> Any:
    with gdsckpt.open(path) as ckpt:
        return ckpt.get_many(ckpt.keys())


READERS: dict[str, Callable[[Path], Any]] = {
    "load": gdsckpt.load, "open().get_many": _get_all, "verify": gdsckpt.verify,
}


def _reads_at(offset: int, inode: int | None = None) -> Callable[..., bool]:
    """Selects ``os.preadv`` calls that start at ``offset`` (of the file ``inode``, if given)."""
    return lambda fd, buffers, position, *a: position == offset and (inode is None
                                                                       or os.fstat(fd).st_ino == inode)


@pytest.mark.parametrize("reader", READERS)
def test_eio_reading_a_chunk_names_the_chunk_and_tensor(reader: str, ckpt_path: Path, saved: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    chunk = len(saved.chunks) // 2
    owner = chunk_owner(saved, chunk)
    with monkeypatch.context() as m:
        fault = Fault("preadv", _reads_at(saved.chunks[chunk].offset), errno.EIO).install(m)
        with pytest.raises(gdsckpt.CheckpointError) as caught:
            READERS[reader](ckpt_path)  # raises: no state is returned
    assert fault.raised >= 1
    message = str(caught.value)
    assert f"chunk {chunk}" in message and repr(owner) in message and "Errno 5" in message, message
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.EIO
    record_figure(f"read error: EIO on a chunk during {reader}", f"CheckpointError: {message}")


@pytest.mark.parametrize("reader", [*READERS, "inspect"])
def test_eio_reading_the_index_raises_oserror_with_its_errno(reader: str, ckpt_path: Path, saved: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    data = ckpt_path.read_bytes()
    index_offset = unpack_trailer(data[-64:], len(data)).index_offset
    call = READERS.get(reader, gdsckpt.inspect)
    with monkeypatch.context() as m:
        fault = Fault("preadv", _reads_at(index_offset), errno.EIO).install(m)
        with pytest.raises(OSError) as caught:
            call(ckpt_path)
    assert fault.raised == 1 and caught.value.errno == errno.EIO
    record_figure(f"read error: EIO on the index during {reader}", f"OSError errno {caught.value.errno}")


@pytest.mark.parametrize("reader", ["load", "open().get_many"])
def test_file_truncated_during_load_names_the_chunk_and_tensor(reader: str, ckpt_path: Path, saved: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is cut half-way through chunk ``cut`` after its index was read, when the first
    chunk read starts: ``CorruptCheckpointError`` naming that chunk and its tensor."""
    cut = len(saved.chunks) // 2
    record = saved.chunks[cut]
    data_start = min(chunk.offset for chunk in saved.chunks)
    data_end = max(chunk.offset + chunk.stored for chunk in saved.chunks)
    original = os.preadv
    truncated = []
    cutting = threading.Lock()

    def preadv(fd: int, buffers: Any, position: int, *args: Any) -> int:
        # Chunks are read in parallel, in any order: every chunk read waits until the cut is made,
        # so none of them can read chunk ``cut`` whole before the file loses its tail.
        if data_start <= position < data_end:
            with cutting:
                if not truncated:
                    os.truncate(ckpt_path, record.offset + record.stored // 2)
                    truncated.append(position)
        return original(fd, buffers, position, *args)

    with monkeypatch.context() as m:
        m.setattr(os, "preadv", preadv)
        with pytest.raises(gdsckpt.CorruptCheckpointError) as caught:
            READERS[reader](ckpt_path)
    assert truncated, "the file was never cut"
    error = caught.value
    assert (error.chunk, error.key) == (cut, chunk_owner(saved, cut)), str(error)
    assert "file ends at" in str(error)
    record_figure(f"file truncated during {reader}", f"CorruptCheckpointError: {error}")


def test_short_reads_load_bit_exact(ckpt_path: Path, saved: Any, monkeypatch: pytest.MonkeyPatch,
                                    h: Any) -> None:
    """Every ``os.preadv`` returns at most 1000 bytes: load, lazy reads and verify still work."""
    original = os.preadv
    short = [0]

    def preadv(fd: int, buffers: Any, position: int, *args: Any) -> int:
        view = memoryview(buffers[0]).cast("B")
        if len(view) > 1000:
            short[0] += 1
            view = view[:1000]
        return original(fd, [view], position, *args)

    with monkeypatch.context() as m:
        m.setattr(os, "preadv", preadv)
        loaded = gdsckpt.load(ckpt_path)
        lazily = _get_all(ckpt_path)
        gdsckpt.verify(ckpt_path)
    expected = state_for(3, ELEMENTS)
    h.assert_same(expected, loaded)
    h.assert_same({k: expected[k] for k in ("weights", "counts", "version")}, lazily)
    assert short[0] > 3 * len(saved.chunks), short
    record_figure("short reads", f"{short[0]} reads cut to 1000 bytes: load, get_many and verify bit-exact")


@pytest.mark.parametrize("verify", [False, True])
def test_restore_latest_stops_on_a_checkpoint_with_an_unreadable_chunk(
        verify: bool, tmp_path: Path, config: gdsckpt.Config, monkeypatch: pytest.MonkeyPatch,
        h: Any) -> None:
    """EIO reading a chunk of the newest checkpoint: ``restore_latest`` raises the
    ``CheckpointError`` naming the chunk (its cause the ``OSError``), restores nothing older,
    warns nothing and changes nothing on disk (an I/O error is no proof of damage, manager.py);
    once the disk reads again, the newest step restores."""
    manager = CheckpointManager(tmp_path, keep_last=2, config=config)
    for step in (1, 2):
        manager.save(step, state_for(step, ELEMENTS))
    index = h.read_index(manager.path(2))
    chunk = len(index.chunks) // 2
    bad = _reads_at(index.chunks[chunk].offset, inode=manager.path(2).stat().st_ino)
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    with monkeypatch.context() as m:
        fault = Fault("preadv", bad, errno.EIO).install(m)
        with pytest.raises(gdsckpt.CheckpointError, match=rf"chunk {chunk}.*Errno 5") as caught:
            manager.restore_latest(verify=verify)  # a SkippedCheckpointWarning would fail the test
    assert fault.raised >= 1 and isinstance(caught.value.__cause__, OSError)
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before
    step, everything = manager.restore_latest(verify=verify)  # type: ignore[misc]
    assert step == 2
    h.assert_same(state_for(2, ELEMENTS), everything)
    record_figure(f"restore_latest(verify={verify}) with EIO on the newest checkpoint",
                  "the CheckpointError naming the chunk raised, nothing older restored")
