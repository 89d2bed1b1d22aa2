"""Replacing a checkpoint that a delta uses as its base is refused unless forced.

A delta records its base's path and content identity (index SHA-256, file length); a new file at
that path breaks the delta for good. ``save``, ``save_async`` and ``convert --overwrite`` over such
a base raise ``BaseCheckpointError`` naming the deltas and leave every file as it was; with
``force=True`` (``--force``) they replace it, and the delta then refuses to load rather than
returning wrong tensors. A delta that no longer matches the file (already broken) does not block.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt import CheckpointManager
from gdsckpt.demo import bit_equal

from .harness import record_figure


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    # a NaN with a payload, -0.0 and inf, by their bits
    bits = np.array([0x7FC00123, 0x80000000, 0x7F800000], dtype=np.uint32)
    special = torch.from_numpy(bits.view(np.float32))
    return {"w": torch.randn(32, 64, generator=g), "special": special,
            "count": torch.arange(9) + seed, "step": seed}


def _assert_bit_equal(loaded: dict, expected: dict) -> None:
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert bit_equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key


@pytest.fixture
def base_and_delta(tmp_path: Path) -> tuple[Path, Path, dict]:
    base, delta = tmp_path / "base.gdsckpt", tmp_path / "delta.gdsckpt"
    gdsckpt.save(_state(0), base)
    delta_state = _state(0)
    delta_state["w"] = delta_state["w"] + 1e-3
    delta_state["step"] = 1
    gdsckpt.save(delta_state, delta, base=base)
    assert gdsckpt.inspect(delta).base is not None
    return base, delta, delta_state


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_save_over_a_base_is_refused_and_changes_nothing(base_and_delta):
    base, delta, delta_state = base_and_delta
    (base.parent / "notes.txt").write_text("not a checkpoint")  # passed over by the search
    (base.parent / "tiny.gdsckpt").write_bytes(b"x")
    before = _files(base.parent)
    started = time.perf_counter()
    with pytest.raises(gdsckpt.BaseCheckpointError, match=r"delta\.gdsckpt.*force=True"):
        gdsckpt.save(_state(7), base)
    elapsed_ms = (time.perf_counter() - started) * 1e3
    record_figure("save over a delta's base",
                  f"refused in {elapsed_ms:.1f} ms (2 checkpoints and 2 other files in the directory)")
    assert _files(base.parent) == before  # base and delta byte-identical, no temporary left
    _assert_bit_equal(gdsckpt.load(delta), delta_state)
    gdsckpt.save(_state(3), base.parent / "notes.txt")  # a file no delta uses is replaced as before
    _assert_bit_equal(gdsckpt.load(base.parent / "notes.txt"), _state(3))


def test_force_replaces_the_base_and_the_delta_then_refuses_to_load(base_and_delta):
    base, delta, _delta_state = base_and_delta
    gdsckpt.save(_state(7), base, force=True)
    _assert_bit_equal(gdsckpt.load(base), _state(7))
    with pytest.raises(gdsckpt.BaseCheckpointError, match="has changed"):
        gdsckpt.load(delta)
    # The delta is broken already: replacing its old base again is no longer refused.
    gdsckpt.save(_state(8), base)
    _assert_bit_equal(gdsckpt.load(base), _state(8))


def test_save_async_over_a_base_is_refused_in_the_caller(base_and_delta):
    base, delta, delta_state = base_and_delta
    before = _files(base.parent)
    with pytest.raises(gdsckpt.BaseCheckpointError, match=r"delta\.gdsckpt"):
        gdsckpt.save_async(_state(7), base)
    gdsckpt.wait_all(timeout=60)
    assert _files(base.parent) == before
    _assert_bit_equal(gdsckpt.load(delta), delta_state)
    gdsckpt.save_async(_state(7), base, force=True).wait(timeout=60)
    _assert_bit_equal(gdsckpt.load(base), _state(7))


def test_a_delta_that_is_its_own_base_chain_link_is_guarded_too(base_and_delta):
    """A delta that is the base of another delta is guarded like a full checkpoint."""
    base, delta, delta_state = base_and_delta
    second = base.parent / "second.gdsckpt"
    gdsckpt.save(_state(2), second, base=delta)
    with pytest.raises(gdsckpt.BaseCheckpointError, match=r"second\.gdsckpt"):
        gdsckpt.save(_state(7), delta, base=base)
    _assert_bit_equal(gdsckpt.load(second), _state(2))
    _assert_bit_equal(gdsckpt.load(delta), delta_state)


def test_convert_overwrite_of_a_base_is_refused_unless_forced(base_and_delta):
    base, delta, delta_state = base_and_delta
    source = base.parent / "source.pt"
    torch.save({"w": torch.zeros(3)}, source)
    before = _files(base.parent)
    with pytest.raises(gdsckpt.BaseCheckpointError, match=r"delta\.gdsckpt"):
        gdsckpt.convert(source, base, overwrite=True)
    assert _files(base.parent) == before

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gdsckpt", "convert", str(source), str(base), *args],
                              capture_output=True, text=True, timeout=120)

    refused = cli("--overwrite")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "delta.gdsckpt" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert _files(base.parent) == before
    _assert_bit_equal(gdsckpt.load(delta), delta_state)
    forced = cli("--overwrite", "--force")
    assert forced.returncode == 0, forced.stderr
    assert bit_equal(gdsckpt.load(base)["w"], torch.zeros(3))


def test_manager_restarted_from_an_older_step_still_overwrites_the_abandoned_run(tmp_path: Path):
    """The manager's documented behaviour: a run restarted from an older step writes its steps over
    the abandoned run's (whose later deltas may use them as bases); ``latest`` names the new one."""
    first = CheckpointManager(tmp_path, keep_last=5, delta_every=1, full_every=100)
    for step in (1, 2, 3):
        first.save(step, _state(step))
    assert gdsckpt.inspect(first.path(3)).base is not None
    second = CheckpointManager(tmp_path, keep_last=5, delta_every=1, full_every=100)
    second.save(2, _state(20))
    assert (tmp_path / "latest").read_text().splitlines()[0] == second.path(2).name
    _assert_bit_equal(gdsckpt.load(second.path(2)), _state(20))
