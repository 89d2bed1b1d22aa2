"""Atomic saves: whatever fails during a save, the path keeps its previous content byte for byte
and no temporary file is left behind; stale temporaries of dead writers are cleaned up."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import gdsckpt
from gdsckpt.codecs import cpu as cpu_codecs
from gdsckpt.io import posix

TEMP_GLOB = ".*.gdsckpt-tmp-*"


@pytest.fixture(autouse=True)
def one_pwrite_per_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests aim faults at single ``os.pwrite`` calls: no O_DIRECT writes are joined into
    one ``pwritev`` here (``tests/reliability/test_coalesced_writes.py`` covers joined writes)."""
    monkeypatch.setattr(posix, "COALESCE_BYTES", 0)


def _old_state() -> dict[str, Any]:
    return {"w": torch.arange(4000, dtype=torch.float32), "step": 1}


def _new_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(6000, generator=g), "b": torch.randn(300, generator=g),
            "tiny": [torch.ones(5) * i for i in range(20)], "step": 2}


def _config(h: Any, **changes: Any) -> Any:
    return h.small_config(fsync=True, io_threads=3, **changes)


def _assert_untouched(directory: Path, path: Path, previous: bytes | None) -> None:
    if previous is None:
        assert not path.exists()
    else:
        assert path.read_bytes() == previous
    assert list(directory.glob(TEMP_GLOB)) == [], "a temporary file was left behind"
    assert sorted(p.name for p in directory.iterdir()) == ([path.name] if previous is not None else [])


class CallCounter:
    """Wraps a function; the wrapper raises ``error()`` from call number ``fail_at`` (0-based) on."""

    def __init__(self, original: Callable[..., Any], fail_at: int | None, error: Callable[[], BaseException]):
        self.original, self.fail_at, self.error = original, fail_at, error
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            number = self.calls
            self.calls += 1
        if self.fail_at is not None and number >= self.fail_at:
            raise self.error()
        return self.original(*args, **kwargs)


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _count_calls(monkeypatch: pytest.MonkeyPatch, target: Any, name: str, run: Callable[[], Any]) -> int:
    counter = CallCounter(getattr(target, name), None, _enospc)
    with monkeypatch.context() as m:
        m.setattr(target, name, counter)
        run()
    return counter.calls


@pytest.fixture
def previous(ckpt_path: Path, h: Any) -> bytes:
    gdsckpt.save(_old_state(), ckpt_path, config=_config(h))
    return ckpt_path.read_bytes()


def test_pwrite_is_what_writes_the_file(ckpt_path: Path, monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    """Guard for the fault injection below: a save goes through os.pwrite in gdsckpt.io.posix."""
    calls = _count_calls(monkeypatch, posix.os, "pwrite",
                         lambda: gdsckpt.save(_new_state(), ckpt_path, config=_config(h)))
    assert calls >= 5


@pytest.mark.parametrize("fail_at", ["header", 1, 2, "middle", "tail"])
def test_write_failure_keeps_previous_file(fail_at: Any, ckpt_path: Path, previous: bytes, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    config = _config(h)
    # Count the pwrite calls of this very save (into a scratch directory), to aim at each phase.
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    total = _count_calls(monkeypatch, posix.os, "pwrite",
                         lambda: gdsckpt.save(_new_state(), scratch / "x.gdsckpt", config=config))
    assert total >= 5
    index = {"header": 0, "middle": total // 2, "tail": total - 1}.get(fail_at, fail_at)
    counter = CallCounter(os.pwrite, index, _enospc)
    with monkeypatch.context() as m:
        m.setattr(posix.os, "pwrite", counter)
        with pytest.raises(OSError) as caught:
            gdsckpt.save(_new_state(), ckpt_path, config=config)
    assert caught.value.errno == errno.ENOSPC
    assert counter.calls > index
    assert ckpt_path.read_bytes() == previous
    assert list(tmp_path.glob(TEMP_GLOB)) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ckpt_path.name, "scratch"])
    # The next save works and replaces the file.
    gdsckpt.save(_new_state(), ckpt_path, config=config)
    h.assert_same(_new_state(), gdsckpt.load(ckpt_path))


def test_write_failure_without_previous_file_leaves_nothing(ckpt_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            h: Any) -> None:
    with monkeypatch.context() as m:
        m.setattr(posix.os, "pwrite", CallCounter(os.pwrite, 3, _enospc))
        with pytest.raises(OSError, match="No space left"):
            gdsckpt.save(_new_state(), ckpt_path, config=_config(h))
    _assert_untouched(ckpt_path.parent, ckpt_path, None)


@pytest.mark.parametrize("fail_at", [0, 1, 4])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt, MemoryError])
def test_encode_failure_keeps_previous_file(fail_at: int, error: type[BaseException], ckpt_path: Path,
                                            previous: bytes, monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    counter = CallCounter(cpu_codecs.ZstdCodec.encode, fail_at, lambda: error("injected encode failure"))

    def encode(self: Any, data: Any) -> Any:
        return counter(self, data)

    with monkeypatch.context() as m:
        m.setattr(cpu_codecs.ZstdCodec, "encode", encode)
        with pytest.raises(error, match="injected encode failure"):
            gdsckpt.save(_new_state(), ckpt_path, codec="zstd", config=_config(h))
    assert counter.calls > fail_at
    _assert_untouched(ckpt_path.parent, ckpt_path, previous)


def test_source_read_failure_keeps_previous_file(ckpt_path: Path, previous: bytes,
                                                 monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    """Reading a tensor's bytes fails part way through the save (e.g. a device error)."""
    from gdsckpt.state import TorchSource

    counter = CallCounter(TorchSource.host_bytes, 3, lambda: RuntimeError("injected read failure"))
    with monkeypatch.context() as m:
        m.setattr(TorchSource, "host_bytes", lambda self, start, stop: counter(self, start, stop))
        with pytest.raises(RuntimeError, match="injected read failure"):
            gdsckpt.save(_new_state(), ckpt_path, config=_config(h))
    assert counter.calls > 3
    _assert_untouched(ckpt_path.parent, ckpt_path, previous)


@pytest.mark.parametrize("name", ["fsync", "replace", "ftruncate"])
def test_commit_failure_keeps_previous_file(name: str, ckpt_path: Path, previous: bytes,
                                            monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    counter = CallCounter(getattr(os, name), 0, lambda: OSError(errno.EIO, "injected I/O error"))
    with monkeypatch.context() as m:
        m.setattr(posix.os, name, counter)
        with pytest.raises(OSError, match="injected I/O error"):
            gdsckpt.save(_new_state(), ckpt_path, config=_config(h))
    assert counter.calls >= 1
    _assert_untouched(ckpt_path.parent, ckpt_path, previous)


def test_unsupported_state_keeps_previous_file(ckpt_path: Path, previous: bytes, h: Any) -> None:
    with pytest.raises(TypeError):
        gdsckpt.save({"w": torch.ones(3), "bad": {1, 2}}, ckpt_path, config=_config(h))
    _assert_untouched(ckpt_path.parent, ckpt_path, previous)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_failed_saves_leak_no_file_descriptors(ckpt_path: Path, previous: bytes,
                                               monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    before = len(os.listdir("/proc/self/fd"))
    for fail_at in (0, 2, 5):
        with monkeypatch.context() as m:
            m.setattr(posix.os, "pwrite", CallCounter(os.pwrite, fail_at, _enospc))
            with pytest.raises(OSError):
                gdsckpt.save(_new_state(), ckpt_path, config=_config(h))
    assert len(os.listdir("/proc/self/fd")) == before


def test_successful_save_leaves_only_the_file(ckpt_path: Path, previous: bytes, h: Any) -> None:
    gdsckpt.save(_new_state(), ckpt_path, config=_config(h))
    assert ckpt_path.read_bytes() != previous
    assert sorted(p.name for p in ckpt_path.parent.iterdir()) == [ckpt_path.name]
    h.assert_same(_new_state(), gdsckpt.load(ckpt_path))


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_temporary_of_a_dead_writer_is_removed(ckpt_path: Path, h: Any) -> None:
    directory = ckpt_path.parent
    stale = directory / f".{ckpt_path.name}.gdsckpt-tmp-{_dead_pid()}-0badc0de"
    stale.write_bytes(b"half a checkpoint")
    other_target = directory / f".other.gdsckpt.gdsckpt-tmp-{_dead_pid()}-0badc0de"
    other_target.write_bytes(b"someone else's")
    live_writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = directory / f".{ckpt_path.name}.gdsckpt-tmp-{live_writer.pid}-12345678"
        live.write_bytes(b"a save in progress")
        gdsckpt.save(_old_state(), ckpt_path, config=_config(h))
        assert not stale.exists(), "the dead writer's temporary file must be removed"
        assert live.exists(), "a live writer's temporary file must be left alone"
        assert other_target.exists(), "temporaries of other targets are not ours to remove"
        h.assert_same(_old_state(), gdsckpt.load(ckpt_path))
    finally:
        live_writer.kill()
        live_writer.wait()


def test_a_temporary_of_an_earlier_process_with_this_pid_is_removed(ckpt_path: Path, h: Any) -> None:
    """A container restarted (or a job in a fresh PID namespace) gets the pid its killed
    predecessor had: that predecessor's temporaries named a live process, this one, and were
    never removed, one checkpoint's worth of disk per crash. The name now carries a token of
    the process as well as its pid."""
    from gdsckpt.io import posix

    directory = ckpt_path.parent
    other_token = "0000" if posix._process_token != "0000" else "ffff"
    predecessor = directory / f".{ckpt_path.name}.gdsckpt-tmp-{os.getpid()}-{other_token}beef"
    predecessor.write_bytes(b"half a checkpoint of the killed incarnation")
    own = directory / f".{ckpt_path.name}.gdsckpt-tmp-{os.getpid()}-{posix._process_token}beef"
    own.write_bytes(b"this process's save in progress")
    gdsckpt.save(_old_state(), ckpt_path, config=_config(h))
    assert not predecessor.exists(), "the earlier incarnation's temporary must be removed"
    assert own.exists(), "this process's own temporary is left alone"
    own.unlink()
    h.assert_same(_old_state(), gdsckpt.load(ckpt_path))


def test_a_temporary_of_another_pid_space_is_left_until_it_is_old(ckpt_path: Path, h: Any) -> None:
    """A process in another container, or on another node of a shared file system, sees other
    processes under the pids: one where the trainer's pid named no process (an evaluation job
    opening the run's ``CheckpointManager``) removed the trainer's live temporary, and its save
    failed at the rename. A pid is now checked only within its own pid space (named in the
    temporary); another space's temporary goes once unchanged for ``FOREIGN_STALE_SECONDS``."""
    from gdsckpt.io import posix

    directory = ckpt_path.parent
    assert posix.temporary_path(ckpt_path).name.endswith(f".{posix._PID_SPACE}")
    other_space = "00000000" if posix._PID_SPACE != "00000000" else "ffffffff"
    dead = _dead_pid()  # here: in the other space, a live writer may have it
    writing = directory / f".{ckpt_path.name}.gdsckpt-tmp-{dead}-0badc0de.{other_space}"
    writing.write_bytes(b"another node's save in progress")
    abandoned = directory / f".{ckpt_path.name}.gdsckpt-tmp-{dead}-1badc0de.{other_space}"
    abandoned.write_bytes(b"another node's save, killed long ago")
    old = time.time() - posix.FOREIGN_STALE_SECONDS - 60
    os.utime(abandoned, (old, old))
    own_space_dead = directory / f".{ckpt_path.name}.gdsckpt-tmp-{dead}-2badc0de.{posix._PID_SPACE}"
    own_space_dead.write_bytes(b"a dead writer of this space")
    gdsckpt.save(_old_state(), ckpt_path, config=_config(h))
    assert writing.exists(), "another space's recent temporary must be left alone"
    assert not abandoned.exists(), "another space's temporary unchanged for an hour is stale"
    assert not own_space_dead.exists(), "a dead writer of this space is checked by its pid"
    writing.unlink()
    h.assert_same(_old_state(), gdsckpt.load(ckpt_path))


def test_a_nested_temporary_of_another_pid_space_under_a_shortened_name_is_left(tmp_path: Path) -> None:
    """A conversion into a long destination name saves into its own temporary, whose save writes
    a temporary of that name, shortened (``.<head>~<digest>.gdsckpt-tmp-...``) with the outer
    name cut inside its pid: the pid was read after the first marker, found no number, and the
    live save of another container was removed as stale."""
    from gdsckpt.io import posix

    other_space = "00000000" if posix._PID_SPACE != "00000000" else "ffffffff"
    pid = 4_000_000  # a long pid, as another space may have: not alive here
    assert not posix._process_alive(pid)
    for length in (40, *range(150, 214, 3)):
        destination = tmp_path / ("m" * (length - len(".safetensors")) + ".safetensors")
        outer = destination.with_name(f"{posix.temporary_prefix(destination)}{pid}-aaaabbbb.{other_space}")
        nested = outer.with_name(f"{posix.temporary_prefix(outer)}{pid}-ccccdddd.{other_space}")
        nested.write_bytes(b"another container's save in progress")
        posix.remove_stale_temporaries(destination)
        assert nested.exists(), length
        nested.unlink()


def test_a_temporary_named_by_an_earlier_version_is_still_removed(tmp_path: Path, h: Any) -> None:
    """Temporaries gained a pid space in their names, which moved where a long target name is
    shortened: a target of 214-217 bytes had its earlier version's temporaries no longer looked
    for, and a dead writer's stayed for good."""
    pid = _dead_pid()
    for length in (100, 215):
        target = tmp_path / ("a" * (length - len(".gdsckpt")) + ".gdsckpt")
        old = target.with_name(f".{target.name}.gdsckpt-tmp-{pid}-abcd1234")  # as it was named then
        old.write_bytes(b"half a checkpoint")
        gdsckpt.save(_old_state(), target, config=_config(h))
        assert not old.exists(), length


def test_readers_never_see_a_temporary_file(ckpt_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            previous: bytes, h: Any) -> None:
    """While a save is half written, loading the path gives the previous checkpoint."""
    seen: list[Any] = []
    original = os.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if not seen:
            seen.append(gdsckpt.load(ckpt_path))
        return original(fd, data, offset)

    with monkeypatch.context() as m:
        m.setattr(posix.os, "pwrite", pwrite)
        gdsckpt.save(_new_state(), ckpt_path, config=_config(h))
    h.assert_same(_old_state(), seen[0])
    h.assert_same(_new_state(), gdsckpt.load(ckpt_path))


def test_publish_without_replace_refuses_an_existing_target_and_keeps_it(tmp_path: Path) -> None:
    from gdsckpt.io.posix import publish, temporary_path

    target = tmp_path / "t.bin"
    target.write_bytes(b"old")
    temp = temporary_path(target)
    temp.write_bytes(b"new")
    with pytest.raises(FileExistsError):
        publish(temp, target, fsync=True, replace=False)
    assert target.read_bytes() == b"old"
    assert not temp.exists()  # a failed publish removes its temporary file
    temp.write_bytes(b"new")
    publish(temp, target, fsync=True)
    assert target.read_bytes() == b"new" and not temp.exists()


def test_write_atomically_replaces_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gdsckpt.io.posix import TEMP_MARKER, write_atomically

    target = tmp_path / "latest"
    write_atomically(target, b"first\n", fsync=True)
    assert target.read_bytes() == b"first\n"

    def failing_replace(*args: object) -> None:
        raise OSError(5, "injected EIO")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="injected"):
        write_atomically(target, b"second\n", fsync=True)
    monkeypatch.undo()
    assert target.read_bytes() == b"first\n"
    assert [p.name for p in tmp_path.iterdir() if TEMP_MARKER in p.name] == []


def test_a_killed_conversions_nested_temporary_is_removed_by_the_next_save(tmp_path: Path, h: Any) -> None:
    """A conversion to gdsckpt saves into a temporary beside its destination, and that save writes
    a temporary of the temporary's name first (``..dst.gdsckpt-tmp-<pid>-<x>.gdsckpt-tmp-...``).
    A conversion killed while writing left that file, which no later save, conversion or manager
    removed (a checkpoint's size each time). The next save or conversion to the destination now
    removes it when its writer is gone, and leaves a live writer's alone."""
    source, target = tmp_path / "source.gdsckpt", tmp_path / "target.gdsckpt"
    gdsckpt.save(_old_state(), source, config=_config(h))
    outer = f".{target.name}.gdsckpt-tmp-{_dead_pid()}-0badc0de"
    nested = tmp_path / f".{outer}.gdsckpt-tmp-{_dead_pid()}-1badc0de"
    nested.write_bytes(b"half a conversion")
    gdsckpt.save(_old_state(), target, config=_config(h))
    assert not nested.exists(), "the killed conversion's temporary must be removed by the next save"
    live_writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f"..{target.name}.gdsckpt-tmp-{live_writer.pid}-0badc0de.gdsckpt-tmp-{live_writer.pid}-1"
        live.write_bytes(b"a conversion in progress")
        again = tmp_path / f"..{target.name}.gdsckpt-tmp-{_dead_pid()}-2badc0de.gdsckpt-tmp-{_dead_pid()}-3"
        again.write_bytes(b"another half")
        gdsckpt.convert(source, target, codec="zstd", overwrite=True, config=_config(h))
        assert not again.exists() and live.exists()
    finally:
        live_writer.kill()
        live_writer.wait()
    h.assert_same(_old_state(), gdsckpt.load(target))


def test_a_save_over_a_checkpoint_keeps_its_permission_bits(tmp_path: Path) -> None:
    """A save writes a temporary and renames it over the file: it came out 0o644 whatever the
    file was, so a checkpoint kept private (0o600) became readable by everyone at the next save
    (``torch.save`` writes in place and keeps them). The temporary of an existing file is 0o600
    until it takes the file's bits; the manager's pointer is published the same way."""
    import stat

    path = tmp_path / "private.gdsckpt"
    gdsckpt.save({"w": torch.zeros(3)}, path)
    for mode in (0o600, 0o640, 0o664):
        os.chmod(path, mode)
        gdsckpt.save({"w": torch.ones(3)}, path)
        assert stat.S_IMODE(os.stat(path).st_mode) == mode
    posix.write_atomically(path, b"small", fsync=False)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o664


_READ_ONLY_CHILD = """
import os, sys
import torch, gdsckpt
path = sys.argv[1]
gdsckpt.save({"w": torch.zeros(3)}, path)
os.chmod(path, 0o444)
try:
    gdsckpt.save({"w": torch.ones(3)}, path)
except PermissionError as err:
    assert "read-only" in str(err), err
else:
    raise SystemExit("a read-only checkpoint was replaced")
assert float(gdsckpt.load(path)["w"].sum()) == 0.0 and oct(os.stat(path).st_mode & 0o777) == "0o444"
# a symlink to that read-only file is replaced, not written through: its target is not checked
link = path + ".link"
os.symlink(path, link)
gdsckpt.save({"w": torch.ones(3)}, link)
assert not os.path.islink(link) and float(gdsckpt.load(link)["w"].sum()) == 3.0
assert oct(os.stat(link).st_mode & 0o777) != "0o444" and float(gdsckpt.load(path)["w"].sum()) == 0.0
# a manager whose pointer was made read-only refuses a save before writing its checkpoint
manager = gdsckpt.CheckpointManager(path + ".run")
manager.save(1, {"w": torch.zeros(3)})
os.chmod(path + ".run/latest", 0o444)
try:
    manager.save(2, {"w": torch.ones(3)})
except PermissionError as err:
    assert "read-only" in str(err), err
else:
    raise SystemExit("a read-only pointer was replaced")
assert not os.path.exists(manager.path(2)) and manager.latest_step() == 1
print("ok")
"""


def test_a_save_refuses_to_replace_a_checkpoint_made_read_only(tmp_path: Path, h: Any) -> None:
    """The rename needs only the directory's permission: a checkpoint the user had made read-only
    ("keep this one") was replaced without a word (``torch.save`` fails to open it). Now a
    ``PermissionError``, the file as it was. Run without the privilege that lets root write any
    file (root passes, as ``torch.save`` does)."""
    command = [sys.executable, "-c", _READ_ONLY_CHILD, str(tmp_path / "golden.gdsckpt")]
    if os.geteuid() == 0:
        command = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=h.subprocess_env())
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
