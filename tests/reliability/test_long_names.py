"""Long file names: every legal name (up to NAME_MAX, 255 bytes) can be saved to.

A save writes ``.<name>.gdsckpt-tmp-<pid>-<random>`` first; for a target name of about 230 bytes
or more that temporary name passed NAME_MAX and the save failed with ENAMETOOLONG. Now a
temporary name that would be too long keeps the head of the target name plus a digest of the
whole name (``io.posix.temporary_prefix``), and the stale-temporary cleanup still recognizes it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gdsckpt
from gdsckpt.io.posix import NAME_MAX, TEMP_MARKER, temporary_path, temporary_prefix, temporary_target

from .harness import record_figure

CONFIG = gdsckpt.Config(fsync=False, timeout=60)


def _name(total_bytes: int, suffix: str = ".gdsckpt", fill: str = "a") -> str:
    """A file name of exactly ``total_bytes`` bytes (UTF-8) ending in ``suffix``."""
    room = total_bytes - len(suffix.encode())
    unit = len(fill.encode())
    name = fill * (room // unit) + "b" * (room % unit) + suffix
    assert len(name.encode()) == total_bytes
    return name


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    w = rng.standard_normal(5_000).astype(np.float32)
    w[:2] = [-0.0, np.float32("nan")]
    return {"w": w, "step": 3}


def _check(loaded: dict[str, Any]) -> None:
    assert loaded["w"].tobytes() == _state()["w"].tobytes()
    assert loaded["step"] == 3


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid


@pytest.mark.parametrize("length", [200, 230, 240, 255])
@pytest.mark.parametrize("fill", ["a", "é", "\u732b"])  # 1-, 2- and 3-byte UTF-8 characters
def test_save_and_load_at_every_legal_length(tmp_path: Path, length: int, fill: str) -> None:
    path = tmp_path / _name(length, fill=fill)
    assert len(os.fsencode(temporary_path(path).name)) <= NAME_MAX
    gdsckpt.save(_state(), path, codec="zstd", config=CONFIG)
    _check(gdsckpt.load(path, config=CONFIG))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind


def test_temporary_prefixes_of_long_names_stay_distinct_and_recognizable(tmp_path: Path) -> None:
    a, b = tmp_path / _name(255, suffix="-1.gdsckpt"), tmp_path / _name(255, suffix="-2.gdsckpt")
    prefix_a, prefix_b = temporary_prefix(a), temporary_prefix(b)
    assert prefix_a != prefix_b and not prefix_a.startswith(prefix_b) and not prefix_b.startswith(prefix_a)
    head, shortened = temporary_target(temporary_path(a).name)
    assert shortened and a.name.startswith(head)
    short = tmp_path / "short.gdsckpt"
    assert temporary_prefix(short) == f".short.gdsckpt{TEMP_MARKER}"
    assert temporary_target(temporary_path(short).name) == ("short.gdsckpt", False)


def test_a_stale_temporary_of_a_long_name_is_removed_by_the_next_save(tmp_path: Path) -> None:
    path = tmp_path / _name(250)
    stale = tmp_path / f"{temporary_prefix(path)}{_dead_pid()}-0badc0de"
    stale.write_bytes(b"partial")
    other = tmp_path / _name(250, suffix="-x.gdsckpt")  # another target's stale temporary stays
    others_stale = tmp_path / f"{temporary_prefix(other)}{_dead_pid()}-0badc0de"
    others_stale.write_bytes(b"partial")
    gdsckpt.save(_state(), path, config=CONFIG)
    assert not stale.exists()
    assert others_stale.exists()


def test_save_async_and_convert_to_a_255_byte_name(tmp_path: Path) -> None:
    path = tmp_path / _name(255)
    gdsckpt.save_async(_state(), path, config=CONFIG).wait(timeout=60)
    _check(gdsckpt.load(path, config=CONFIG))
    converted = tmp_path / _name(255, suffix=".safetensors")
    pytest.importorskip("safetensors")
    gdsckpt.convert(path, converted, config=CONFIG)
    back = tmp_path / _name(255, suffix="-back.gdsckpt")
    gdsckpt.convert(converted, back, config=CONFIG)
    loaded = gdsckpt.load(back, config=CONFIG)
    assert np.asarray(loaded["w"]).tobytes() == _state()["w"].tobytes()


def test_manager_with_a_long_prefix_saves_restores_and_cleans_up(tmp_path: Path) -> None:
    prefix = "p" * 230  # checkpoint names of 249 bytes: their temporaries are shortened
    manager = gdsckpt.CheckpointManager(tmp_path, prefix=prefix, keep_last=1, config=CONFIG)
    stale = tmp_path / f"{temporary_prefix(manager.path(7))}{_dead_pid()}-0badc0de"
    stale.write_bytes(b"partial")
    for step in (1, 2):
        manager.save(step, _state())
    result = gdsckpt.CheckpointManager(tmp_path, prefix=prefix, config=CONFIG).restore_latest()
    assert result is not None and result[0] == 2
    _check(result[1])
    assert not stale.exists()  # step 7's save died: the next manager removed its temporary
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([manager.path(2).name, "latest"])
    record_figure("255-byte names", "save, save_async, convert and a manager with a 230-byte prefix "
                  "work; temporaries stay within NAME_MAX (before: ENAMETOOLONG from 230 bytes on)")
