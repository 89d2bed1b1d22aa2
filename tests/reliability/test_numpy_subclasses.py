"""NumPy subclasses (issue 16, item 8): a ``MaskedArray`` saved as a plain ndarray loses its mask,
an ``np.matrix`` its semantics. ``save`` refuses them, as it refuses torch tensor subclasses, with a
``TypeError`` naming the key path and the type, before anything is written: a checkpoint already
at the target path stays as it was. ``np.memmap`` is the exception: its elements are all it holds,
so it is saved and comes back, bit-exact, as a plain ndarray. ``load_into`` refuses a NumPy
target (subclass or not) before reading.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gdsckpt

from .harness import record_figure


class _Tagged(np.ndarray):
    """A user subclass carrying an attribute a plain ndarray would drop."""

    unit = "m"


class _TaggedFloat(np.float64):
    """A user subclass of a NumPy scalar type."""


def _matrix() -> np.matrix:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)  # NumPy discourages np.matrix
        return np.matrix([[1, 2], [3, 4]])


# case -> (value at state["outer"]["inner"], qualified type name the message must give)
SUBCLASSES: dict[str, tuple[Callable[[], Any], str]] = {
    "MaskedArray": (lambda: np.ma.array([1.0, -0.0, np.nan], mask=[False, True, False]),
                    "numpy.ma.MaskedArray"),
    "masked constant": (lambda: np.ma.masked, "MaskedConstant"),
    "matrix": (_matrix, "numpy.matrix"),
    "recarray of a plain dtype": (lambda: np.arange(3.0).view(np.recarray), "recarray"),
    "user ndarray subclass": (lambda: np.arange(4, dtype=np.int16).view(_Tagged), "_Tagged"),
    "user scalar subclass": (lambda: _TaggedFloat(1.5), "_TaggedFloat"),
}


@pytest.mark.parametrize("case", list(SUBCLASSES))
def test_numpy_subclass_is_refused_before_anything_is_written(case: str, tmp_path: Path) -> None:
    build, type_name = SUBCLASSES[case]
    path = tmp_path / "state.gdsckpt"
    gdsckpt.save({"outer": {"inner": np.arange(3.0)}}, path)
    before = path.read_bytes()
    with pytest.raises(TypeError, match="NumPy (array|scalar) subclass") as caught:
        gdsckpt.save({"ok": torch.ones(3), "outer": {"inner": build()}}, path)
    message = str(caught.value)
    assert "'outer/inner'" in message and type_name in message, message
    assert path.read_bytes() == before, "the checkpoint already at the path was changed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.gdsckpt"], "a failed save left a file behind"
    record_figure(f"numpy subclass | {case}", message[:160])


def test_memmap_is_saved_as_its_elements_bit_exact(tmp_path: Path) -> None:
    bits = np.array([0x7FF8_0000_0000_1234, 0x8000_0000_0000_0000, 0x3FF0_0000_0000_0000], dtype=np.uint64)
    mapped = np.memmap(tmp_path / "data.bin", dtype=np.float64, mode="w+", shape=(3,))
    mapped[:] = bits.view(np.float64)  # a NaN with a payload, -0.0 and 1.0
    mapped.flush()
    path = tmp_path / "state.gdsckpt"
    gdsckpt.save({"whole": mapped, "row": mapped[1:]}, path)
    loaded = gdsckpt.load(path)
    assert type(loaded["whole"]) is np.ndarray and type(loaded["row"]) is np.ndarray
    assert loaded["whole"].tobytes() == bits.tobytes()
    assert loaded["row"].tobytes() == bits[1:].tobytes()
    del mapped


def test_load_into_refuses_a_masked_array_target_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "state.gdsckpt"
    gdsckpt.save({"x": np.arange(3.0)}, path)
    target = {"x": np.ma.array([5.0, 6.0, 7.0], mask=[False, True, False])}
    with pytest.raises(TypeError, match=r"MaskedArray at 'x'"):
        gdsckpt.load_into(target, path)
    assert target["x"].data.tobytes() == np.array([5.0, 6.0, 7.0]).tobytes()
    assert target["x"].mask.tolist() == [False, True, False]
