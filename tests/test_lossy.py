"""Opt-in lossy compression (``gdsckpt.lossy``, ``save(lossy=...)``): the grid rule's error bound
and bit-exact special values over random arrays, the save/load round trip, the warning, inspect,
index validation of the ``lossy`` member, and the sensitivity and comparison tools."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gdsckpt
from gdsckpt.cli.main import main as cli_main
from gdsckpt.demo import TinyGPT, bit_equal, training_state
from gdsckpt.state import lossy, lossy_analysis

PROPERTY = settings(max_examples=120, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

WIDTH = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
# Quiet and signalling NaNs with payloads (both signs), +-inf, +-0.0, the smallest subnormal (both
# signs), the largest subnormal, the largest finite value (both signs) and 1.0.
SPECIAL = {
    "float16": [0x7E01, 0xFE7F, 0x7C01, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x7BFF,
                0xFBFF, 0x3C00],
    "bfloat16": [0x7FC1, 0xFF81, 0x7F81, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x7F7F,
                 0xFF7F, 0x3F80],
    "float32": [0x7FC00001, 0xFFC12345, 0x7F800001, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
                0x00000001, 0x80000001, 0x007FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000],
    "float64": [0x7FF8000000000123, 0xFFF8DEADBEEF0000, 0x7FF0000000000001, 0x7FF0000000000000,
                0xFFF0000000000000, 0, 0x8000000000000000, 1, 0x8000000000000001, 0x000FFFFFFFFFFFFF,
                0x7FEFFFFFFFFFFFFF, 0xFFEFFFFFFFFFFFFF, 0x3FF0000000000000],
}


def _bits_of_float(value: float, dtype: str) -> int:
    with np.errstate(all="ignore"):  # 1e30 in float16 is meant to become inf
        if dtype == "bfloat16":
            return int(np.array([value], dtype=np.float32).view(np.uint32)[0]) >> 16
        return int(np.array([value], dtype=dtype).view(UINT[WIDTH[dtype]])[0])


@st.composite
def float_arrays(draw: st.DrawFn) -> tuple[str, np.ndarray]:
    """(dtype, element bits): raw random bits (any NaN payload, subnormals), special patterns, and
    ordinary, huge and tiny values, so every array mixes all of them."""
    dtype = draw(st.sampled_from(list(WIDTH)))
    width = WIDTH[dtype]
    element = st.one_of(
        st.integers(0, (1 << (8 * width)) - 1),
        st.sampled_from(SPECIAL[dtype]),
        st.floats(-1e4, 1e4, width=32).map(lambda v: _bits_of_float(v, dtype)),
        st.sampled_from([1e-30, -3e-41, 1e30, -2.5e38, 6e4, -1e-7, 1e-300, 1e300]).map(
            lambda v: _bits_of_float(v, dtype)),
    )
    bits = draw(st.lists(element, min_size=1, max_size=48))
    return dtype, np.array(bits, dtype=UINT[width])


def _torch_of(dtype: str, bits: np.ndarray) -> torch.Tensor:
    signed = {2: torch.int16, 4: torch.int32, 8: torch.int64}[bits.itemsize]
    return torch.from_numpy(bits.view(f"<i{bits.itemsize}").copy()).to(signed).view(getattr(torch, dtype))


def _as_float64(values: Any) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.to(torch.float64).reshape(-1).numpy()
    with np.errstate(invalid="ignore"):  # converting a signalling NaN raises the invalid flag
        return np.asarray(values, dtype=np.float64).reshape(-1)


def _bits(values: Any) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        signed = {2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()]
        return values.contiguous().reshape(-1).view(signed).numpy().copy()
    native = values.astype(values.dtype.newbyteorder("="))  # a byte swap for big-endian input
    return np.ascontiguousarray(native).reshape(-1).view(f"i{values.itemsize}").copy()


def check_grid(original: Any, result: lossy.GridResult | None, rel: float) -> None:
    """The grid rule's guarantees for one array and its result."""
    x = _as_float64(original)
    finite = np.isfinite(x)
    amax = float(np.abs(x[finite]).max()) if finite.any() else 0.0
    if result is None:
        assert rel * amax == 0, "only an array with no finite nonzero value is left alone"
        return
    y = _as_float64(result.values)
    native = original.dtype if isinstance(original, torch.Tensor) else original.dtype.newbyteorder("=")
    assert result.values.dtype == native and tuple(result.values.shape) == tuple(original.shape)
    assert result.abs_bound == rel * amax and result.rel_bound == rel
    assert result.step <= 2 * result.abs_bound and math.frexp(result.step)[0] == 0.5  # a power of two
    error = np.abs(y[finite] - x[finite])  # exact in float64: nearby floats
    assert np.all(error <= result.abs_bound)
    assert result.max_error == (float(error.max()) if error.size else 0.0)
    before, after = _bits(original), _bits(result.values)
    assert np.array_equal(after[~finite], before[~finite]), "NaN / inf bit patterns (payloads) kept"
    assert np.all(np.isfinite(y[finite])), "no finite value becomes inf"
    # -0.0 stays -0.0, and a value rounding to zero keeps its sign (a negative one becomes -0.0)
    assert np.array_equal(np.signbit(y[finite]), np.signbit(x[finite]))


@PROPERTY
@given(float_arrays(), st.sampled_from([0.3, 1e-2, 1e-3, 1e-6]), st.booleans(), st.booleans())
def test_grid_bound_and_special_values_torch(case: tuple[str, np.ndarray], rel: float, strided: bool,
                                             chunked: bool) -> None:
    dtype, bits = case
    tensor = _torch_of(dtype, bits)
    if strided and tensor.numel() >= 4:
        tensor = tensor[: tensor.numel() // 2 * 2].reshape(2, -1).t()  # a non-contiguous view
    before = _bits(tensor)
    with mock.patch.object(lossy, "CHUNK_ELEMENTS", 5 if chunked else lossy.CHUNK_ELEMENTS):
        result = lossy.grid_quantize(tensor, rel)
    assert np.array_equal(_bits(tensor), before), "the caller's tensor is never modified"
    check_grid(tensor, result, rel)
    if result is not None and dtype != "bfloat16":  # NumPy computes the very same values
        same = lossy.grid_quantize(tensor.numpy(), rel)
        assert same is not None and np.array_equal(_bits(same.values), _bits(result.values))
        figures = (same.abs_bound, same.step, same.max_error)
        assert figures == (result.abs_bound, result.step, result.max_error)


@PROPERTY
@given(float_arrays().filter(lambda case: case[0] != "bfloat16"), st.sampled_from([0.3, 1e-2, 1e-3, 1e-6]),
       st.booleans())
def test_grid_bound_and_special_values_numpy(case: tuple[str, np.ndarray], rel: float,
                                             big_endian: bool) -> None:
    dtype, bits = case
    array = bits.view(dtype)
    if big_endian:
        array = array.astype(array.dtype.newbyteorder(">"))
    before = array.copy()
    with mock.patch.object(lossy, "CHUNK_ELEMENTS", 5):
        result = lossy.grid_quantize(array, rel)
    assert before.tobytes() == array.tobytes()
    check_grid(array, result, rel)


def test_grid_edges() -> None:
    # Rounding 65504 (float16's largest) to a step of 2^15 would give 65536 = inf: kept as it is.
    big = torch.tensor([65504.0, -65504.0, 1.0, -1.0], dtype=torch.float16)
    result = lossy.grid_quantize(big, 0.4)
    assert result is not None and result.step == 32768.0
    assert result.values.tolist() == [65504.0, -65504.0, 0.0, -0.0]
    assert torch.signbit(result.values).tolist() == [False, True, False, True]
    # No finite nonzero value, other dtypes, a bound that underflows: nothing to round.
    assert lossy.grid_quantize(torch.tensor([0.0, -0.0, float("nan")]), 1e-2) is None
    assert lossy.grid_quantize(torch.arange(10), 1e-2) is None
    assert lossy.grid_quantize(torch.zeros(0), 1e-2) is None
    assert lossy.grid_quantize(torch.tensor([5e-324], dtype=torch.float64), 1e-3) is None
    # float64 values near its maximum: the step is capped at 2^1023 instead of overflowing.
    huge = lossy.grid_quantize(torch.tensor([1.7e308, -1e308, 3.0], dtype=torch.float64), 0.9)
    assert huge is not None and huge.step == 2.0 ** 1023 and huge.max_error <= huge.abs_bound
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        lossy.grid_quantize(torch.ones(3), 0.0)


def test_a_bound_the_measurement_breaks_stores_losslessly(monkeypatch: pytest.MonkeyPatch) -> None:
    # A step twice too large (as a broken rule would give) makes errors exceed the bound: the
    # measured error in float64 catches it and the array is left to the lossless path.
    monkeypatch.setattr(lossy, "_grid_step", lambda amax, rel: (rel * amax, 4 * rel * amax))
    values = torch.linspace(-1, 1, 1001)
    assert lossy.grid_quantize(values, 1e-2) is None
    assert lossy.grid_quantize(values.numpy(), 1e-2) is None


def test_policy_matching_and_validation() -> None:
    policy = gdsckpt.LossyPolicy({"*.exp_avg_sq": 1e-2, "optimizer.state.*.exp_avg": 1e-3, "model/*": 0.5})
    assert policy.bound_for("optimizer/state/0/exp_avg_sq") == 1e-2
    assert policy.bound_for("optimizer/state/12/exp_avg") == 1e-3
    assert policy.bound_for("model/blocks.0.qkv.weight") == 0.5
    assert policy.bound_for("optimizer/state/0/step") is None
    assert gdsckpt.LossyPolicy([("*", 0.1), ("a", 0.2)]).bound_for("a") == 0.1  # first match wins
    for bad in (0, 1, -0.1, float("nan"), True, "0.1", np.bool_(True), np.float32("nan")):
        with pytest.raises(ValueError, match="relative error bound"):
            gdsckpt.LossyPolicy({"*": bad})
    # a NumPy number is a number (np.float32 was refused while np.float64, a float, was taken)
    assert gdsckpt.LossyPolicy({"*": np.float32(0.25)}).bound_for("x") == 0.25
    assert gdsckpt.LossyPolicy({"*": np.float64(0.25)}).bound_for("x") == 0.25
    with pytest.raises(ValueError, match="mode"):
        gdsckpt.LossyPolicy({"*": 0.1}, mode="q8")
    with pytest.raises(TypeError):
        gdsckpt.LossyPolicy.of(["*"])  # type: ignore[arg-type]


def test_policy_bitcomp_switch_reaches_each_rounded_source() -> None:
    """``LossyPolicy.bitcomp`` (may the GPU engine store grid-rounded arrays as Bitcomp lossy
    streams) defaults to True, must be a bool, and travels with every array's rounding."""
    from gdsckpt.state import flatten

    assert gdsckpt.LossyPolicy({"*": 0.1}).bitcomp is True
    for bad in (1, "no", None):
        with pytest.raises(TypeError, match="bitcomp"):
            gdsckpt.LossyPolicy({"*": 0.1}, bitcomp=bad)  # type: ignore[arg-type]
    state = {"w": torch.randn(64), "h": torch.randn(64).half(), "n": np.linspace(-1, 1, 64)}
    for switch in (True, False):
        flat = flatten(state)
        assert sorted(lossy.apply_policy(flat, gdsckpt.LossyPolicy({"*": 0.01}, bitcomp=switch))) == ["h", "n", "w"]
        sources = {a.key: a.source for a in flat.arrays}
        assert {k: s.rounding.bitcomp for k, s in sources.items()} == {"w": switch, "h": switch, "n": switch}
        assert {k: s.dtype for k, s in sources.items()} == {"w": "float32", "h": "float16", "n": "float64"}


# ---------------------------------------------------------------------------------------------
# save / load

def _lossy_state() -> dict[str, Any]:
    model, optimizer = training_state(width=32, depth=1, steps=2, vocab=64)
    extra = np.linspace(-3, 3, 500).astype(np.float32)
    extra[[0, 7]] = [np.nan, -np.inf]
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "extra": extra,
            "counts": torch.arange(100), "step": 2}


POLICY = {"*.exp_avg_sq": 1e-2, "optimizer.state.*.exp_avg": 1e-3, "extra": 1e-2, "counts": 1e-2}


def _flat(state: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "/"))
        else:
            out[name] = value
    return out


def _lossy_warnings(record: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in record if issubclass(w.category, gdsckpt.LossyWarning)]


def test_save_load_round_trip(ckpt_path: Path, h: Any) -> None:
    state = _lossy_state()
    flat = _flat(state)
    snapshot = {k: v.clone() if isinstance(v, torch.Tensor) else np.copy(v) for k, v in flat.items()
                if isinstance(v, (torch.Tensor, np.ndarray))}
    report = gdsckpt.save(state, ckpt_path, lossy=POLICY, config=h.small_config())
    expected = sorted(k for k in flat if k.endswith(("/exp_avg", "/exp_avg_sq")) or k == "extra")
    assert sorted(report.lossy) == expected and len(expected) > 3
    for key, value in snapshot.items():  # the caller's arrays are untouched
        current = flat[key]
        if isinstance(value, torch.Tensor):
            assert bit_equal(value, current), key
        else:
            assert value.tobytes() == current.tobytes(), key

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loaded = gdsckpt.load(ckpt_path)
    caught = _lossy_warnings(record)
    assert len(caught) == 1 and f"{len(expected)} loaded array(s)" in str(caught[0].message)

    records = {t.key: t for t in gdsckpt.inspect(ckpt_path).tensors}
    for key, restored in _flat(loaded).items():
        saved = flat[key]
        if key not in expected:  # bit-exact
            assert key not in records or records[key].lossy is None
            assert bit_equal(saved, restored) if isinstance(saved, torch.Tensor) else saved == restored, key
            continue
        info = records[key].lossy
        assert info is not None and info["mode"] == "grid"
        assert info["rel_bound"] == (1e-3 if key.endswith("/exp_avg") else 1e-2)
        x, y = _as_float64(saved), _as_float64(restored)
        finite = np.isfinite(x)
        assert np.array_equal(_bits(saved)[~finite], _bits(restored)[~finite])
        error = np.abs(y[finite] - x[finite])
        assert float(error.max()) == info["max_error"] <= info["abs_bound"]
        assert info["abs_bound"] == info["rel_bound"] * float(np.abs(x[finite]).max())

    # load_into warns once too; a partial load of lossless arrays does not warn.
    model, optimizer = training_state(width=32, depth=1, steps=0, vocab=64, seed=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        gdsckpt.load_into({"model": model, "optimizer": optimizer}, ckpt_path, strict=False)
        assert len(_lossy_warnings(record)) == 1
        record.clear()
        gdsckpt.load(ckpt_path, keys=["model"])
        with gdsckpt.open(ckpt_path) as ckpt:
            ckpt.get("counts")
        assert _lossy_warnings(record) == []
        with gdsckpt.open(ckpt_path) as ckpt:
            ckpt.get("extra")
        assert len(_lossy_warnings(record)) == 1


def test_lossless_is_the_default(ckpt_path: Path, h: Any) -> None:
    state = {"w": torch.randn(300), "m": torch.randn(300)}
    report = gdsckpt.save(state, ckpt_path, config=h.small_config())
    assert report.lossy == ()
    assert all(t.lossy is None for t in gdsckpt.inspect(ckpt_path).tensors)
    assert "lossy" not in json.dumps([t.to_json() for t in h.read_index(ckpt_path).tensors])
    report = gdsckpt.save(state, ckpt_path, lossy={"nothing*": 1e-2}, config=h.small_config())
    assert report.lossy == ()
    loaded = gdsckpt.load(ckpt_path)  # no warning (warnings are errors in this suite)
    assert bit_equal(loaded["w"], state["w"]) and bit_equal(loaded["m"], state["m"])
    with pytest.raises(TypeError, match="LossyPolicy"):
        gdsckpt.save(state, ckpt_path.with_name("other.gdsckpt"), lossy=0.01)  # type: ignore[arg-type]
    assert not ckpt_path.with_name("other.gdsckpt").exists()


def test_alias_follows_its_target(ckpt_path: Path, h: Any) -> None:
    weight = torch.randn(400)
    state = {"embed": weight, "head": weight}  # tied: stored once, as "embed"
    report = gdsckpt.save(state, ckpt_path, lossy={"embed": 1e-2}, config=h.small_config())
    assert report.lossy == ("embed", "head")  # the alias loads rounded too, so it is reported
    infos = {t.key: t for t in gdsckpt.inspect(ckpt_path).tensors}
    assert infos["head"].alias_of == "embed" and infos["head"].lossy == infos["embed"].lossy is not None
    with pytest.warns(gdsckpt.LossyWarning, match="2 loaded"):
        loaded = gdsckpt.load(ckpt_path)
    assert loaded["head"] is loaded["embed"]


def test_inspect_cli_shows_lossy_fields(ckpt_path: Path, h: Any, capsys: pytest.CaptureFixture[str]) -> None:
    state = {"opt": {"exp_avg": torch.randn(1000), "exp_avg_sq": torch.rand(1000)}, "w": torch.randn(10)}
    gdsckpt.save(state, ckpt_path, lossy={"*.exp_avg*": 1e-3}, config=h.small_config())
    info = {t.key: t.lossy for t in gdsckpt.inspect(ckpt_path).tensors}
    assert info["w"] is None and set(info["opt/exp_avg"]) == {"mode", "rel_bound", "abs_bound", "max_error"}
    assert cli_main(["inspect", str(ckpt_path)]) == 0
    text = capsys.readouterr().out
    assert "2 lossy arrays" in text
    line = next(line for line in text.splitlines()
                if line.strip().startswith("opt/exp_avg_sq") and "grid" in line)
    assert "0.001" in line and f"{info['opt/exp_avg_sq']['max_error']:.4g}" in line
    assert cli_main(["inspect", "--json", str(ckpt_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    by_key = {t["key"]: t["lossy"] for t in doc["tensors"]}
    assert by_key == info


@pytest.mark.parametrize("bad", [
    "grid", [], {"rel_bound": 0.1, "abs_bound": 0.1, "max_error": 0.0},
    {"mode": 3, "rel_bound": 0.1, "abs_bound": 0.1, "max_error": 0.0},
    {"mode": "grid", "abs_bound": 0.1, "max_error": 0.0},
    {"mode": "grid", "rel_bound": -0.1, "abs_bound": 0.1, "max_error": 0.0},
    {"mode": "grid", "rel_bound": 0.1, "abs_bound": "0.1", "max_error": 0.0},
    {"mode": "grid", "rel_bound": 0.1, "abs_bound": 0.1, "max_error": True},
])
def test_malformed_lossy_member_is_corrupt(ckpt_path: Path, h: Any, bad: Any) -> None:
    gdsckpt.save({"w": torch.randn(100)}, ckpt_path, lossy={"w": 1e-2}, config=h.small_config())

    def edit(doc: dict[str, Any]) -> None:
        doc["tensors"][0]["lossy"] = bad

    h.rewrite_index(ckpt_path, edit)
    with pytest.raises(gdsckpt.CorruptCheckpointError, match="lossy"):
        gdsckpt.inspect(ckpt_path)


def test_infinite_bound_in_lossy_member_is_corrupt() -> None:
    from gdsckpt.format import parse_index

    # 1e999 is valid JSON that Python reads as inf; NaN and Infinity are refused earlier.
    raw = (b'{"format":"gdsckpt","version":[1,0],"checksum":"crc32c","chains":[[{"name":"none/1"}]],'
           b'"chunks":[[4096,8,8,0,0]],"tensors":[{"key":"a","kind":"numpy","dtype":"float64","shape":[1],'
           b'"segments":[[0,0,8]],"lossy":{"mode":"grid","rel_bound":0.1,"abs_bound":%s,"max_error":0}}],'
           b'"tree":{"t":"tensor","id":0}}')
    assert parse_index(raw % b"0.5", index_offset=8192).tensors[0].lossy == {
        "mode": "grid", "rel_bound": 0.1, "abs_bound": 0.5, "max_error": 0}
    with pytest.raises(gdsckpt.CorruptCheckpointError, match="abs_bound"):
        parse_index(raw % b"1e999", index_offset=8192)


def test_lossy_member_serialises_last_and_keeps_unknown_members(ckpt_path: Path, h: Any) -> None:
    gdsckpt.save({"w": torch.randn(100)}, ckpt_path, lossy={"w": 1e-2}, config=h.small_config())
    record = h.read_index(ckpt_path).tensors[0]
    assert list(record.to_json())[-1] == "lossy" and "lossy" not in record.extra

    def edit(doc: dict[str, Any]) -> None:
        doc["tensors"][0]["lossy"].update(mode="future", extra_member=[1])

    h.rewrite_index(ckpt_path, edit)
    assert gdsckpt.inspect(ckpt_path).tensors[0].lossy["mode"] == "future"


# ---------------------------------------------------------------------------------------------
# analysis tools

def test_sensitivity_smoke() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, width=32, depth=1, context=16).eval()
    tokens = torch.randint(0, 64, (4, 17))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def loss_fn(module: TinyGPT, batch: torch.Tensor) -> torch.Tensor:
        logits = module(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))

    results = lossy_analysis.sensitivity(model, loss_fn, tokens, ["embed", "blocks.0", "*.weight", "missing"])
    assert [(r.group, r.rel_bound) for r in results] == [
        (g, b) for g in ("embed", "blocks.0", "*.weight", "missing") for b in (1e-2, 1e-3)]
    assert all(math.isfinite(r.rel_change) and r.base_loss == results[0].base_loss for r in results)
    assert results[0].keys == ("embed.weight",) and results[-1].keys == () and results[-1].rel_change == 0.0
    weights = dict(model.named_parameters())
    for r in results:
        assert r.max_error <= r.rel_bound * max((weights[k].abs().max().item() for k in r.keys), default=0.0)
    assert any(r.rel_change != 0.0 for r in results)
    assert all(bit_equal(before[k], v) for k, v in model.state_dict().items()), "originals restored"
    own = lossy_analysis.sensitivity(model, loss_fn, tokens, {"*.weight": 0.05}, rel_bounds=None)
    assert len(own) == 1 and own[0].rel_bound == 0.05 and own[0].keys


def test_compare_modes_reports_both() -> None:
    values = torch.randn(20000) * 1e-3
    figures = lossy_analysis.compare_modes(values, 1e-2)
    assert figures["raw_bytes"] == 80000
    assert 0 < figures["grid_bytes"] < 80000 and 0 < figures["q8_bytes"] < 80000
    assert figures["grid_max_error"] <= figures["abs_bound"]
    assert figures["q8_within_bound"] == (figures["q8_max_error"] <= figures["abs_bound"])
    half = lossy_analysis.compare_modes(values.to(torch.bfloat16), 1e-3)
    assert half["raw_bytes"] == 40000


@PROPERTY
@given(float_arrays(), st.sampled_from([0.3, 1e-2, 1e-3, 1e-6]), st.booleans())
def test_mantissa_mode_bounds_each_element_relatively(case: tuple[str, np.ndarray], rel: float,
                                                      chunked: bool) -> None:
    dtype, bits = case
    tensor = _torch_of(dtype, bits)
    before = _bits(tensor)
    with mock.patch.object(lossy, "CHUNK_ELEMENTS", 5 if chunked else lossy.CHUNK_ELEMENTS):
        result = lossy.quantize_whole(tensor, rel, "mantissa")
    assert np.array_equal(_bits(tensor), before), "the caller's tensor is never modified"
    if result is None:  # no mantissa bits to spare at this bound, or nothing finite and nonzero
        x = _as_float64(tensor)
        assert lossy._mantissa_drop(dtype, rel) == 0 or not np.any(np.isfinite(x) & (x != 0))
        return
    x, y = _as_float64(tensor), _as_float64(result.values)
    finite = np.isfinite(x)
    error = np.abs(y[finite] - x[finite])
    assert np.all(error <= rel * np.abs(x[finite])), "every element within rel of its own magnitude"
    assert result.max_error == (float(error.max()) if error.size else 0.0) and result.mode == "mantissa"
    after = _bits(result.values)
    assert np.array_equal(after[~finite], before[~finite]), "NaN / inf bit patterns (payloads) kept"
    assert np.array_equal(np.signbit(y[finite]), np.signbit(x[finite]))
    if dtype != "bfloat16":  # NumPy computes the very same bits
        same = lossy.quantize_whole(tensor.numpy(), rel, "mantissa")
        assert same is not None and np.array_equal(_bits(same.values), after)


def test_mantissa_rule_in_a_policy_round_trips(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    second_moment = torch.rand(4096, generator=g) ** 8 * 1e-4  # many orders of magnitude
    state = {"optimizer": {"exp_avg": torch.randn(4096, generator=g) * 1e-3, "exp_avg_sq": second_moment},
             "model": {"w": torch.randn(64, generator=g)}}
    policy = {"*.exp_avg": 1e-2, "*.exp_avg_sq": ("mantissa", 1e-2)}
    report = gdsckpt.save(state, tmp_path / "m.gdsckpt", codec="zstd", lossy=policy)
    assert set(report.lossy) == {"optimizer/exp_avg", "optimizer/exp_avg_sq"}
    modes = {t.key: t.lossy["mode"] for t in gdsckpt.inspect(tmp_path / "m.gdsckpt").tensors if t.lossy}
    assert modes == {"optimizer/exp_avg": "grid", "optimizer/exp_avg_sq": "mantissa"}
    with pytest.warns(lossy.LossyWarning):
        loaded = gdsckpt.load(tmp_path / "m.gdsckpt")
    v, w = second_moment.double(), loaded["optimizer"]["exp_avg_sq"].double()
    assert torch.all((w - v).abs() <= 1e-2 * v.abs()) and torch.all((w == 0) == (v == 0))
    assert bit_equal(loaded["model"]["w"], state["model"]["w"])
    with pytest.raises(ValueError, match="mode"):
        lossy.LossyPolicy({"*": ("blockwise", 1e-2)})


def test_a_lossy_save_holds_no_rounded_copy_of_the_array(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounding happens chunk by chunk as the pipeline reads: host memory during the save stays
    far below the array's size (a rounded copy alone would be the whole 64 MiB)."""
    import tracemalloc

    array = np.random.default_rng(3).standard_normal(16 << 20, dtype=np.float32)  # 64 MiB
    # Each codec thread rounds its own 1 MiB chunk with float64 temporaries (a few MiB per thread),
    # so the thread count is fixed: with one thread per core the peak grows with the machine, not
    # with the array, and a 16-core host would pass 32 MiB without any rounded copy existing.
    config = gdsckpt.Config(chunk_bytes=1 << 20, max_inflight_bytes=8 << 20, io_threads=2, codec_threads=2)
    monkeypatch.setattr(lossy, "CHUNK_ELEMENTS", 1 << 16)
    tracemalloc.start()
    try:
        report = gdsckpt.save({"exp_avg": array}, tmp_path / "big.gdsckpt", codec="zstd", config=config,
                              lossy={"exp_avg": 1e-2})
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.lossy == ("exp_avg",)
    assert peak < array.nbytes // 2, f"peak {peak / 2**20:.1f} MiB while saving a {array.nbytes >> 20} MiB array"
    with pytest.warns(lossy.LossyWarning):
        loaded = gdsckpt.load(tmp_path / "big.gdsckpt")["exp_avg"]
    bound = gdsckpt.inspect(tmp_path / "big.gdsckpt").tensors[0].lossy["abs_bound"]
    assert np.max(np.abs(loaded.astype(np.float64) - array)) <= bound


def test_save_async_and_the_manager_take_a_lossy_policy(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(9)
    state = {"optimizer": {"exp_avg": torch.randn(5000, generator=g)}, "model": {"w": torch.randn(50, generator=g)}}
    report = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", lossy={"*exp_avg": 1e-2}).wait(timeout=60)
    assert report.lossy == ("optimizer/exp_avg",)
    manager = gdsckpt.CheckpointManager(tmp_path / "run", lossy={"*exp_avg": 1e-2})
    assert manager.save(1, state).lossy == ("optimizer/exp_avg",)
    assert manager.save_async(2, state).wait(timeout=60).lossy == ("optimizer/exp_avg",)
    with pytest.warns(lossy.LossyWarning):
        loaded = gdsckpt.load(manager.path(2))
    assert bit_equal(loaded["model"]["w"], state["model"]["w"])


def test_lossy_saves_in_a_delta_chain_load_as_their_grids(tmp_path: Path, h: Any) -> None:
    """A lossy save with ``base=`` stores the XOR of its rounded values with the base's stored
    ones (themselves rounded): every link loads as its own grid, bit for bit (-0.0 included)."""
    g = torch.Generator().manual_seed(12)
    moment = torch.randn(20000, generator=g) * 1e-3
    moment[:3] = torch.tensor([float("nan"), -0.0, -1e-9])
    paths, grids = [], []
    for step in range(3):
        moment = moment + torch.randn(20000, generator=g) * 1e-5
        path = tmp_path / f"{step}.gdsckpt"
        report = gdsckpt.save({"m": moment, "w": moment.double()}, path, base=paths[-1] if paths else None,
                              lossy={"m": 1e-2}, config=h.small_config())
        assert report.lossy == ("m",) and report.delta_tensors == (2 if paths else 0)
        paths.append(path)
        grids.append((lossy.grid_quantize(moment, 1e-2).values, moment.double()))
    for path, (grid, exact) in zip(paths, grids):
        with pytest.warns(lossy.LossyWarning):
            loaded = gdsckpt.load(path)
        assert bit_equal(loaded["m"], grid) and bit_equal(loaded["w"], exact)


@pytest.mark.parametrize("mode", ["grid", "mantissa"])
def test_a_chunk_is_rounded_in_bounded_steps_with_the_same_bits(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                                mode: str) -> None:
    """A save rounded each chunk's range at once (float64 temporaries of 20-60 bytes per element,
    per codec thread, beside the chunk: about 1 GiB more than lossless for 64 MiB chunks). It now
    rounds ``CHUNK_ELEMENTS`` at a time: no step is larger, and the file's bits are the same."""
    from gdsckpt.state import lossy as lossy_module

    rng = np.random.default_rng(5)
    state = {"m": {"exp_avg": torch.from_numpy(rng.standard_normal(300_001).astype(np.float32))}}
    policy = {"*exp_avg": (mode, 1e-2)}
    whole = tmp_path / "whole.gdsckpt"
    gdsckpt.save(state, whole, lossy=policy, codec="zstd", chunk_bytes=1 << 20)
    steps: list[int] = []
    original = lossy_module.RoundedSource._rounded

    def recording(self: Any, start: int, stop: int) -> Any:
        steps.append(stop - start)
        return original(self, start, stop)

    monkeypatch.setattr(lossy_module, "CHUNK_ELEMENTS", 10_000)
    monkeypatch.setattr(lossy_module.RoundedSource, "_rounded", recording)
    stepped = tmp_path / "stepped.gdsckpt"
    gdsckpt.save(state, stepped, lossy=policy, codec="zstd", chunk_bytes=1 << 20)
    assert steps and max(steps) <= 10_000 * 4
    with pytest.warns(gdsckpt.LossyWarning):
        a, b = gdsckpt.load(whole), gdsckpt.load(stepped)
    assert a["m"]["exp_avg"].view(torch.int32).equal(b["m"]["exp_avg"].view(torch.int32))


def test_a_rebase_reports_the_rounded_arrays_it_carries(tmp_path: Any) -> None:
    """The file a ``rebase`` writes keeps its source's lossy records, but its report said
    ``lossy == ()``, as if every array were bit-exact."""
    g = torch.Generator().manual_seed(2)
    moment = torch.randn(50_000, generator=g)
    state = {"exp_avg": moment, "tied": moment, "w": torch.randn(100, generator=g)}
    source = tmp_path / "a.gdsckpt"
    report = gdsckpt.save(state, source, lossy={"exp_avg": 1e-2})
    assert report.lossy == ("exp_avg", "tied")
    assert gdsckpt.rebase(source, tmp_path / "b.gdsckpt").lossy == report.lossy
    assert gdsckpt.save({"w": state["w"]}, tmp_path / "d.gdsckpt").lossy == ()
