"""Adversarial checks of flattening a state (``gdsckpt.state.tree``), its dtypes and snapshots.

Each test is a finding of an adversarial pass: a state the writer accepted but that wrote a
file every load refuses (views of one memory as two ml_dtypes dtypes, shapes beyond the format's
limits), a save that never ended (an expanded tensor of a huge logical size), a snapshot that
changed a view's dtype without an error, a supported dtype refused, ``keys=`` entries that failed
inside the selection naming nothing, and aliases of lossy arrays left out of the reports. A
refused save must leave the file that was there as it was."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt.demo import bit_equal
from gdsckpt.format.index import MAX_DIMS, MAX_TENSOR_BYTES, shape_limit_error


def _ml_dtypes() -> Any:
    """ml_dtypes, which NumPy's bfloat16 and float8 arrays need; these tests skip without it."""
    return pytest.importorskip("ml_dtypes")


def _good_file(path: Path) -> bytes:
    """Write a loadable checkpoint at ``path`` and return its bytes (a refused save keeps them)."""
    gdsckpt.save({"good": torch.arange(4)}, path)
    return path.read_bytes()


# ---------------------------------------------------------------------------------------------
# views of one memory as different dtypes

def test_numpy_views_as_two_ml_dtypes_are_two_arrays(ckpt_path: Path, h: Any) -> None:
    """Every ml_dtypes float8 has dtype.str "<V1": keyed by it, a float8_e4m3fnuz view of a
    float8_e4m3fn array became an alias record of the other dtype, and the save replaced a good
    file with one every load refused as corrupt."""
    ml_dtypes = _ml_dtypes()
    a = np.array([0x08, 0x40, 0x80, 0xF8], dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    b = a.view(ml_dtypes.float8_e4m3fnuz)  # same memory, another dtype
    c = a.view(ml_dtypes.float8_e5m2)
    _good_file(ckpt_path)
    gdsckpt.save({"a": a, "b": b, "c": c, "a_again": a}, ckpt_path, config=h.small_config())
    gdsckpt.verify(ckpt_path)
    loaded = gdsckpt.load(ckpt_path)
    for key, value in {"a": a, "b": b, "c": c}.items():
        assert loaded[key].dtype == value.dtype, key
        assert h.array_bytes(loaded[key]) == h.array_bytes(value), key
    assert loaded["a_again"] is loaded["a"]  # a true alias is still one array


def test_torch_views_as_two_float8_dtypes_are_two_arrays(ckpt_path: Path) -> None:
    """The torch counterpart (no ml_dtypes needed): views of one storage as two float8 dtypes are
    two arrays, each with its dtype and bits; the same view twice is one."""
    raw = torch.tensor([0x08, 0x40, 0x80, 0xF8], dtype=torch.uint8)
    state = {"fn": raw.view(torch.float8_e4m3fn), "fnuz": raw.view(torch.float8_e4m3fnuz),
             "e5m2": raw.view(torch.float8_e5m2), "u8": raw, "fn_again": raw.view(torch.float8_e4m3fn)}
    _good_file(ckpt_path)
    gdsckpt.save(state, ckpt_path)
    loaded = gdsckpt.load(ckpt_path)
    for key in ("fn", "fnuz", "e5m2", "u8"):
        assert loaded[key].dtype == state[key].dtype and bit_equal(loaded[key], state[key]), key
    assert bit_equal(loaded["fn_again"], state["fn"])
    gdsckpt.save_async(state, ckpt_path).wait(timeout=60)
    loaded = gdsckpt.load(ckpt_path)
    for key in ("fn", "fnuz", "e5m2", "u8"):
        assert loaded[key].dtype == state[key].dtype and bit_equal(loaded[key], state[key]), key


def test_save_async_keeps_each_ml_dtypes_view_its_dtype(ckpt_path: Path, h: Any) -> None:
    """The snapshot's view cache was keyed by dtype.str too: save_async stored the
    float8_e4m3fnuz view as the float8_e4m3fn array itself, and it loaded with the wrong dtype
    and values, without an error anywhere."""
    ml_dtypes = _ml_dtypes()
    a = np.array([0x08, 0x40, 0x80, 0xF8], dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    b = a.view(ml_dtypes.float8_e4m3fnuz)
    expected = {"a": a.copy(), "b": b.copy()}
    gdsckpt.save_async({"a": a, "b": b}, ckpt_path, config=h.small_config()).wait(timeout=60)
    loaded = gdsckpt.load(ckpt_path)
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype, key
        assert h.array_bytes(loaded[key]) == h.array_bytes(value), key


# ---------------------------------------------------------------------------------------------
# dtypes

def test_numpy_float8_e5m2_is_saved(ckpt_path: Path, h: Any) -> None:
    """ml_dtypes reports kind 'f' for float8_e5m2 (kind 'V' for its other types): it was refused
    as unsupported although the format and the message list it."""
    ml_dtypes = _ml_dtypes()
    array = np.array([0x00, 0x3C, 0x7C, 0xFF, 0x80], dtype=np.uint8).view(ml_dtypes.float8_e5m2)
    gdsckpt.save({"e5m2": array}, ckpt_path)
    loaded = gdsckpt.load(ckpt_path)["e5m2"]
    assert loaded.dtype == array.dtype and h.array_bytes(loaded) == h.array_bytes(array)
    assert gdsckpt.inspect(ckpt_path).tensors[0].dtype == "float8_e5m2"


# ---------------------------------------------------------------------------------------------
# shapes beyond the format's limits

@pytest.mark.parametrize("make", [
    pytest.param(lambda: torch.empty(0, 2**62), id="torch-empty-dim-2^62"),
    pytest.param(lambda: np.empty((0, 2**58)), id="numpy-empty-span-2^61"),
    pytest.param(lambda: torch.zeros([1] * (MAX_DIMS + 1)), id="torch-65-dims"),
])
def test_shapes_the_reader_refuses_are_refused_at_save(ckpt_path: Path, make: Any) -> None:
    """A zero-element array whose other dimension is 2**60 or more, or whose dimensions span
    more than 2**60 bytes, or an array of more than 64 dimensions, all legal in torch or NumPy,
    were saved over a good file as one that load, open and verify refused as corrupt. Now save
    and save_async refuse them with a ValueError naming the key, and the file stays as it was."""
    value = make()
    before = _good_file(ckpt_path)
    with pytest.raises(ValueError, match="'model/w'"):
        gdsckpt.save({"model": {"w": value}, "good": torch.arange(4)}, ckpt_path)
    with pytest.raises(ValueError, match="'model/w'"):
        gdsckpt.save_async({"model": {"w": value}}, ckpt_path).wait(timeout=60)
    assert ckpt_path.read_bytes() == before
    assert [p.name for p in ckpt_path.parent.iterdir()] == [ckpt_path.name]  # no temporary left
    assert bit_equal(gdsckpt.load(ckpt_path)["good"], torch.arange(4))


def test_shapes_at_the_limits_still_save(ckpt_path: Path) -> None:
    """The largest shapes the reader accepts save and load: 64 dimensions, and an empty array
    whose dimensions span exactly 2**60 bytes."""
    at_limit = {"dims": torch.zeros([1] * MAX_DIMS), "span": torch.empty(0, MAX_TENSOR_BYTES // 4),
                "numpy": np.empty((0, MAX_TENSOR_BYTES // 8)),
                "widest": torch.empty(0, MAX_TENSOR_BYTES - 1, dtype=torch.uint8)}
    for value in at_limit.values():
        itemsize = value.element_size() if isinstance(value, torch.Tensor) else value.itemsize
        assert shape_limit_error(tuple(value.shape), itemsize) is None
    gdsckpt.save(at_limit, ckpt_path)
    loaded = gdsckpt.load(ckpt_path)
    for key, value in at_limit.items():
        assert tuple(loaded[key].shape) == tuple(value.shape), key
    assert bit_equal(loaded["dims"], at_limit["dims"])


def test_expanded_tensor_of_huge_logical_size_is_refused_before_planning(ckpt_path: Path) -> None:
    """A stride-0 view of 2**62 elements holds 4 bytes of memory but 2**64 logical bytes: save
    started planning ~4e12 chunks and grew without end. It is refused by the size check, before
    its source is made (a conjugate view would be materialized there) and before planning."""
    before = _good_file(ckpt_path)
    huge = {"t": torch.zeros(1).expand(2**62),
            "c": torch.zeros(1, dtype=torch.complex64).expand(2**61).conj()}
    for key, value in huge.items():
        with pytest.raises(ValueError, match=f"'{key}'.*2\\*\\*60"):
            gdsckpt.save({key: value}, ckpt_path)
        with pytest.raises(ValueError, match=f"'{key}'"):
            gdsckpt.save_async({key: value}, ckpt_path).wait(timeout=60)
    assert ckpt_path.read_bytes() == before


def test_a_shape_within_the_limit_for_one_dtype_is_checked_again_for_a_wider_one(ckpt_path: Path) -> None:
    """Flattening checks each (shape, dtype) once: the same empty shape spans 2**60 bytes as
    uint16 (the limit, accepted) and 2**61 as float32. The float32 array after the uint16 one is
    refused, by name, and the file stays as it was."""
    shape = (0, MAX_TENSOR_BYTES // 2)
    before = _good_file(ckpt_path)
    state = {"narrow": torch.empty(shape, dtype=torch.uint16), "wide": torch.empty(shape, dtype=torch.float32)}
    with pytest.raises(ValueError, match="'wide'.*2\\*\\*60"):
        gdsckpt.save(state, ckpt_path)
    assert ckpt_path.read_bytes() == before
    many = {f"t{i}": torch.empty(shape, dtype=torch.uint16) for i in range(3)}
    gdsckpt.save(many, ckpt_path)  # the repeated shape, found good once, saves
    assert [tuple(t.shape) for t in gdsckpt.load(ckpt_path).values()] == [shape] * 3


def test_a_save_while_another_thread_imports_torch_does_not_read_its_missing_parts(tmp_path: Path) -> None:
    """While ``import torch`` runs in one thread, ``sys.modules["torch"]`` is a module half made:
    ``Tensor`` appears early, ``nn`` late. A save in another thread meanwhile raised
    ``AttributeError`` for a state of scalars (flatten read ``torch.nn.Parameter`` up front), and
    for NumPy arrays before ``Tensor`` appeared. Both save and load now; the half-made module is
    put in place by hand, in a process of its own that never imports torch."""
    script = textwrap.dedent(f"""
        import sys, types
        import numpy as np
        half = types.ModuleType("torch")
        sys.modules["torch"] = half
        import gdsckpt
        gdsckpt.save({{"step": 1, "lr": 0.1}}, {str(tmp_path / "scalars.gdsckpt")!r})
        gdsckpt.save({{"w": np.arange(4.0)}}, {str(tmp_path / "numpy.gdsckpt")!r})
        half.Tensor = type("Tensor", (), {{}})  # later in torch's import: Tensor made, nn not yet
        gdsckpt.save({{"w": np.arange(4.0)}}, {str(tmp_path / "numpy2.gdsckpt")!r})
        assert gdsckpt.load({str(tmp_path / "scalars.gdsckpt")!r}) == {{"step": 1, "lr": 0.1}}
        assert (gdsckpt.load({str(tmp_path / "numpy2.gdsckpt")!r})["w"] == np.arange(4.0)).all()
    """)
    done = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# keys= of a partial load

@pytest.mark.parametrize("keys, named", [
    pytest.param([0], "0", id="int-entry"), pytest.param([None], "None", id="none-entry"),
    pytest.param(["state/0", 1], "1", id="int-after-a-key"), pytest.param(b"state", "bytes", id="bytes"),
    pytest.param(bytearray(b"s"), "bytearray", id="bytearray"), pytest.param(5, "int", id="not-iterable"),
    pytest.param([b"state"], "b'state'", id="bytes-entry"),
])
def test_load_keys_that_are_not_strings_are_refused_naming_them(tmp_path: Path, keys: Any, named: str) -> None:
    """keys=[0] (a list index or int dict key as an int), [None], or b"state" (iterated to ints)
    failed inside the selection with "unsupported operand type(s) for +: 'int' and 'str'",
    naming no key. Now a TypeError names the entry, before any file is opened."""
    path = tmp_path / "k.gdsckpt"
    gdsckpt.save({"state": {0: torch.ones(1)}}, path)
    with pytest.raises(TypeError, match="keys") as caught:
        gdsckpt.load(path, keys=keys)
    assert named in str(caught.value)
    with pytest.raises(TypeError, match="keys"):  # refused before the (missing) file is opened
        gdsckpt.load(tmp_path / "missing.gdsckpt", keys=keys)


def test_load_empty_key_is_the_root(tmp_path: Path) -> None:
    """The empty string is the root's key path (docs/format.md §7.3): keys="" and keys=[""]
    select the whole state, a lone array at the root included; keys=[] selects nothing."""
    path = tmp_path / "root.gdsckpt"
    state = {"state": {0: torch.ones(1)}, "n": 3}
    gdsckpt.save(state, path)
    for keys in ("", [""]):
        loaded = gdsckpt.load(path, keys=keys)
        assert loaded.keys() == state.keys() and loaded["n"] == 3
        assert bit_equal(loaded["state"][0], state["state"][0])
    assert gdsckpt.load(path, keys=[]) == {}
    gdsckpt.save(torch.arange(3), path)
    assert bit_equal(gdsckpt.load(path, keys=""), torch.arange(3))
    assert bit_equal(gdsckpt.load(path, keys=np.array(["", ""])), torch.arange(3))  # numpy.str_ entries


# ---------------------------------------------------------------------------------------------
# lossy arrays and their aliases

def test_alias_of_a_lossy_array_is_reported(ckpt_path: Path, h: Any) -> None:
    """With lossy={"a": ...} and "b" the same tensor, "b" comes back rounded too (an alias follows
    its array) but SaveReport.lossy listed only "a" and the load warning counted 1 array."""
    torch.manual_seed(0)
    weight = torch.randn(1000)
    report = gdsckpt.save({"a": weight, "b": weight, "c": weight.clone()}, ckpt_path, lossy={"a": 1e-2},
                          config=h.small_config())
    assert report.lossy == ("a", "b")
    with pytest.warns(gdsckpt.LossyWarning, match="2 loaded"):
        loaded = gdsckpt.load(ckpt_path)
    assert loaded["b"] is loaded["a"] and not bit_equal(loaded["b"], weight)
    assert bit_equal(loaded["c"], weight)  # named by no rule and no alias: bit-exact
    with pytest.warns(gdsckpt.LossyWarning, match="1 loaded"):
        only_b = gdsckpt.load(ckpt_path, keys=["b"])
    assert bit_equal(only_b["b"], loaded["a"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gdsckpt.load(ckpt_path, keys=["c"])  # no lossy entry: no warning
    # a rule naming only the alias rounds nothing: the array it aliases is stored as it is
    report = gdsckpt.save({"a": weight, "b": weight}, ckpt_path, lossy={"b": 1e-2}, config=h.small_config())
    assert report.lossy == ()
    assert bit_equal(gdsckpt.load(ckpt_path)["b"], weight)


def test_a_state_whose_index_would_pass_the_cap_is_refused_and_the_old_file_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state of more than 1 GiB of plain values (a vocabulary as one string) saved and replaced
    the previous checkpoint with a file every load refuses ("index ... exceeds the cap"). The cap
    is lowered here so that a small state reaches it: the save is refused, the old file kept."""
    from gdsckpt.format import layout

    path = tmp_path / "a.gdsckpt"
    gdsckpt.save({"w": torch.ones(4), "vocab": "short"}, path)
    before = path.read_bytes()
    monkeypatch.setattr(layout, "MAX_INDEX_BYTES", 64 << 10)
    with pytest.raises(ValueError, match="over the format's 65536-byte cap"):
        gdsckpt.save({"w": torch.ones(4), "vocab": "x" * (100 << 10)}, path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["a.gdsckpt"]
    assert gdsckpt.load(path)["vocab"] == "short"
