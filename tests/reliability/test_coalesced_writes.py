"""O_DIRECT chunk writes joined into one ``pwritev`` (``gdsckpt.io.posix.COALESCE_BYTES``).

While ``HOLD_WHILE_RUNNING`` writes are running, the next consecutive O_DIRECT writes wait and go
to storage together. Storage is made slow by a fault that delays each write (the only way to make
writes pile up on demand); every other part is real: files, O_DIRECT, fsync, the save pipeline.
Each case checks the file loads bit-exact, or that a failure leaves the previous file and no
temporary, as for single writes (``test_io_errors.py``).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gdsckpt
from gdsckpt.io import posix
from gdsckpt.io.posix import TEMP_MARKER, PosixWriter

CHUNK = 64 << 10


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(5)
    return {"w": rng.standard_normal(400_000).astype(np.float32), "b": rng.integers(0, 9, 70_000, dtype=np.int64)}


def _config(**changes: Any) -> gdsckpt.Config:
    # o_direct=True: chunks stored as they are would otherwise be written buffered, from the
    # state's memory (``HostEngine.as_is_views``), and only O_DIRECT writes are joined
    return gdsckpt.Config(chunk_bytes=CHUNK, codec_threads=2, io_threads=4, o_direct=True, **changes)


def _needs_o_direct(path: Path) -> None:
    writer = PosixWriter(path)
    try:
        if "+odirect" not in writer.name:
            pytest.skip(f"{path.parent} refuses O_DIRECT: no write is joined there")
    finally:
        writer.abort()


class SlowWrites:
    """Wraps ``os.pwrite`` and ``os.pwritev``: each call sleeps ``delay`` seconds first, and the
    buffer count of every ``pwritev`` is recorded. ``fail``: (function name, errno, from which
    call of it on) to fail instead; ``short``: write at most half of what is asked."""

    def __init__(self, delay: float = 0.01, fail: tuple[str, int, int] | None = None, short: bool = False):
        self.delay, self.fail, self.short = delay, fail, short
        self.vectors: list[int] = []
        self.calls = {"pwrite": 0, "pwritev": 0}
        self._lock = threading.Lock()
        self._pwrite, self._pwritev = os.pwrite, os.pwritev

    def _count(self, name: str) -> int:
        with self._lock:
            number = self.calls[name]
            self.calls[name] += 1
        return number

    def _maybe_fail(self, name: str, number: int) -> None:
        if self.fail is not None and self.fail[0] == name and number >= self.fail[2]:
            raise OSError(self.fail[1], os.strerror(self.fail[1]))

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        number = self._count("pwrite")
        time.sleep(self.delay)
        self._maybe_fail("pwrite", number)
        view = memoryview(data).cast("B")
        if self.short and len(view) > 4096:
            view = view[:len(view) // 2 // 4096 * 4096 or 4096]
        return self._pwrite(fd, view, offset)

    def pwritev(self, fd: int, buffers: list[Any], offset: int) -> int:
        number = self._count("pwritev")
        with self._lock:
            self.vectors.append(len(buffers))
        time.sleep(self.delay)
        self._maybe_fail("pwritev", number)
        if self.short:
            first = memoryview(buffers[0]).cast("B")
            return self._pwrite(fd, first[:max(4096, len(first) // 2 // 4096 * 4096)], offset)
        return self._pwritev(fd, buffers, offset)


def _install(monkeypatch: pytest.MonkeyPatch, slow: SlowWrites) -> None:
    monkeypatch.setattr(posix.os, "pwrite", slow.pwrite)
    monkeypatch.setattr(posix.os, "pwritev", slow.pwritev)


def test_writes_waiting_on_slow_storage_are_joined_and_the_file_is_bit_exact(
        ckpt_path: Path, monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    _needs_o_direct(ckpt_path)
    slow = SlowWrites()
    _install(monkeypatch, slow)
    report = gdsckpt.save(_state(), ckpt_path, codec="none", config=_config())
    monkeypatch.undo()
    assert report.chunks >= 20
    assert slow.vectors and max(slow.vectors) > 1, slow.vectors
    # every chunk went out once, alone (pwrite: also the header and the tail) or joined
    assert sum(slow.vectors) + slow.calls["pwrite"] >= report.chunks + 2
    assert slow.calls["pwritev"] < report.chunks
    h.assert_same(_state(), gdsckpt.load(ckpt_path))
    gdsckpt.verify(ckpt_path)  # raises on a chunk whose bytes or checksum are wrong


def test_nothing_is_joined_beyond_the_coalesce_bound(ckpt_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     h: Any) -> None:
    _needs_o_direct(ckpt_path)
    monkeypatch.setattr(posix, "COALESCE_BYTES", 3 * CHUNK)
    slow = SlowWrites()
    _install(monkeypatch, slow)
    gdsckpt.save(_state(), ckpt_path, codec="none", config=_config())
    monkeypatch.undo()
    assert slow.vectors and max(slow.vectors) <= 3
    h.assert_same(_state(), gdsckpt.load(ckpt_path))


def test_short_joined_writes_save_bit_exact(ckpt_path: Path, monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    _needs_o_direct(ckpt_path)
    slow = SlowWrites(short=True)
    _install(monkeypatch, slow)
    gdsckpt.save(_state(), ckpt_path, codec="none", config=_config())
    monkeypatch.undo()
    assert slow.vectors and max(slow.vectors) > 1
    h.assert_same(_state(), gdsckpt.load(ckpt_path))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_failed_joined_write_keeps_the_previous_file(code: int, ckpt_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    _needs_o_direct(ckpt_path)
    previous_state = {"old": np.arange(10, dtype=np.int32)}
    gdsckpt.save(previous_state, ckpt_path)
    previous = ckpt_path.read_bytes()
    slow = SlowWrites(fail=("pwritev", code, 0))
    _install(monkeypatch, slow)
    with pytest.raises(OSError) as caught:
        gdsckpt.save(_state(), ckpt_path, codec="none", config=_config())
    monkeypatch.undo()
    assert caught.value.errno == code
    assert slow.calls["pwritev"] >= 1
    assert ckpt_path.read_bytes() == previous
    assert not [p for p in ckpt_path.parent.iterdir() if TEMP_MARKER in p.name]
    gdsckpt.save(_state(), ckpt_path, codec="none", config=_config())
    h.assert_same(_state(), gdsckpt.load(ckpt_path))


def test_a_refused_joined_o_direct_write_is_written_buffered(ckpt_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             h: Any) -> None:
    """EINVAL from an O_DIRECT ``pwritev`` (a filesystem that takes O_DIRECT at open but not
    for this write): the same bytes go through the buffered descriptor."""
    _needs_o_direct(ckpt_path)
    slow = SlowWrites()
    direct_fds: set[int] = set()
    real_open = os.open

    def tracking_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, **kwargs)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def refusing_pwritev(fd: int, buffers: list[Any], offset: int) -> int:
        if fd in direct_fds:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return slow.pwritev(fd, buffers, offset)

    monkeypatch.setattr(posix.os, "open", tracking_open)
    monkeypatch.setattr(posix.os, "pwrite", slow.pwrite)
    monkeypatch.setattr(posix.os, "pwritev", refusing_pwritev)
    gdsckpt.save(_state(), ckpt_path, codec="none", config=_config())
    monkeypatch.undo()
    assert slow.vectors and max(slow.vectors) > 1  # the buffered retries of joined writes
    h.assert_same(_state(), gdsckpt.load(ckpt_path))


def test_a_write_submitted_after_abort_is_refused_and_counts_nothing(tmp_path: Path) -> None:
    writer = PosixWriter(tmp_path / "x.gdsckpt")
    writer.submit_write(0, np.zeros(4096, dtype=np.uint8)).result(timeout=30)
    writer.abort()
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit_write(4096, np.zeros(4096, dtype=np.uint8))
    assert writer.backlog() in (0, None)
    pace = writer.pace()
    assert pace is None or pace.pending_bytes == 0
    assert not list(tmp_path.iterdir())
