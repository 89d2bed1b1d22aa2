"""Round trips over the whole state matrix, compared bit for bit.

Every value is saved and loaded back, then compared by type, structure, dtype, shape and the exact
bytes of its elements (NaN payloads, -0.0, signalling NaNs and subnormals included), for every
codec and byte-plane setting, with chunks small enough that arrays span several chunks and small
arrays share packed chunks.
"""

from __future__ import annotations

import collections
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gdsckpt

CODECS = ["auto", "zstd", "lz4", "deflate", "none"]
BYTE_PLANES = ["always", "never", "auto"]

TORCH_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2,
]
NUMPY_DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16",
                "float32", "float64", "complex64", "complex128"]

# Special bit patterns per element width of floating types: quiet NaNs with payloads, negative
# NaNs, signalling NaNs, +-inf, -0.0, the smallest subnormal and a normal number.
SPECIAL_BITS = {
    "float16": [0x7E01, 0xFE7F, 0x7C01, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x3C00],
    "bfloat16": [0x7FC1, 0xFF81, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x3F80],
    "float32": [0x7FC00001, 0xFFC12345, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001,
                0x3F800000],
    "float64": [0x7FF8000000000123, 0xFFF8DEADBEEF0000, 0x7FF0000000000001, 0x7FF0000000000000,
                0xFFF0000000000000, 0x8000000000000000, 0x0000000000000001, 0x3FF0000000000000],
    "float8_e4m3fn": [0x7F, 0xFF, 0x80, 0x01, 0x7E, 0x38],
    "float8_e5m2": [0x7D, 0x7E, 0xFF, 0x7C, 0xFC, 0x80, 0x01, 0x3C],
}
SPECIAL_BITS["complex64"] = SPECIAL_BITS["float32"]
SPECIAL_BITS["complex128"] = SPECIAL_BITS["float64"]
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def torch_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], rng: np.random.Generator) -> torch.Tensor:
    """A tensor whose bytes are random (so floats include arbitrary NaN payloads)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = int(np.prod(shape))
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    raw = rng.integers(0, 256, size=count * itemsize, dtype=np.uint8)
    if dtype == torch.bool:
        raw %= 2
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def from_bits(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose elements (or complex components) have exactly these bit patterns."""
    width = torch.empty((), dtype=dtype).element_size() // (2 if dtype.is_complex else 1)
    ints = np.array(bits, dtype=_UNSIGNED[width]).view(_SIGNED[width])
    if dtype.is_complex and len(ints) % 2:
        ints = np.concatenate([ints, ints[:1]])
    return torch.from_numpy(ints.copy()).view(dtype)


def torch_matrix(rng: np.random.Generator) -> dict[str, Any]:
    """Every torch dtype in every layout the library claims to handle."""
    out: dict[str, Any] = {}
    for dtype in TORCH_DTYPES:
        dense = random_tensor(dtype, (24, 40), rng)
        entries = {
            "dense": dense,
            "zero_d": dense[3, 5].clone(),
            "zero_d_view": dense[7, 9],
            "empty": dense[:0],
            "empty_mid": torch.empty((2, 0, 3), dtype=dtype),
            "transposed": dense.t(),
            "strided": dense[1::3, ::2],
            "column": dense[:, 7],
            "expanded": dense[2:3].expand(5, 40),
            "offset_view": dense[5:9, 3:30],
            "one_element_strided": dense[3:4, 5:12:3][:, :1],  # one element, last stride 3
        }
        if torch_name(dtype) in SPECIAL_BITS:
            entries["special"] = from_bits(SPECIAL_BITS[torch_name(dtype)], dtype)
        out[torch_name(dtype)] = entries
    # Larger float32 views whose rows (384 bytes) straddle 4 KiB chunk boundaries.
    big = random_tensor(torch.float32, (64, 96), rng)
    out["multi_chunk"] = {"dense": big, "transposed": big.t(), "expanded": big[5].expand(40, 96),
                          "strided": big[::2, 1::3], "permuted": big.reshape(8, 8, 96).permute(2, 0, 1)}
    out["parameters"] = [torch.nn.Parameter(random_tensor(torch.float32, (7, 5), rng)),
                         torch.nn.Parameter(random_tensor(torch.float32, (3,), rng), requires_grad=False),
                         torch.nn.Parameter(torch.zeros(0))]
    return out


def numpy_matrix(rng: np.random.Generator) -> dict[str, Any]:
    """Every native NumPy dtype, both byte orders, C/F order, negative strides, 0-d, scalars."""
    out: dict[str, Any] = {}
    for name in NUMPY_DTYPES:
        native = np.dtype(name)
        orders = ["<", ">"] if native.itemsize > 1 and name != "bool" else ["|"]
        for order in orders:
            dtype = native.newbyteorder(order) if order != "|" else native
            raw = rng.integers(0, 256, size=30 * 20 * dtype.itemsize, dtype=np.uint8)
            if name == "bool":
                raw %= 2
            array = raw.view(dtype).reshape(30, 20)
            out[f"{name}{order}"] = {
                "dense": array,
                "transposed": array.T,
                "reversed": array[::-1, ::-3],
                "fortran": np.asfortranarray(array),
                "zero_d": np.array(array[4, 4]).astype(dtype),
                "empty": array[:, :0],
                "scalar": array[2, 3],  # a NumPy scalar (np.float64 included: a float subclass)
            }
    out["numpy_specials"] = {
        "float32": np.array(SPECIAL_BITS["float32"], dtype=np.uint32).view(np.float32),
        "float64_be": np.array(SPECIAL_BITS["float64"], dtype=np.uint64).view(np.float64).astype(">f8"),
        "float16": np.array(SPECIAL_BITS["float16"], dtype=np.uint16).view(np.float16),
        "nan_scalar64": np.array([0x7FF8000000000ABC], dtype=np.uint64).view(np.float64)[0],
        "negzero_scalar32": np.float32(-0.0),
        "scalars": [np.bool_(True), np.int8(-3), np.uint64(2**64 - 1), np.float16(1.5), np.float64(2.25),
                    np.complex64(1 - 2j), np.complex128(-0.0 + 1j), np.int64(-(2**63))],
    }
    return out


def python_values(float_from_bits: Any) -> dict[str, Any]:
    return {
        "ints": [0, 1, -1, 2**63, -(2**63) - 1, 2**200 + 7, -(3**300)],
        "floats": [0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), 5e-324, 1.7976931348623157e308,
                   float_from_bits(0x7FF8000000000123), float_from_bits(0xFFF8000000004242)],
        "bools": (True, False),
        "strings": ["", "plain", "ünïcødé ✓ 日本", "slash/and~tilde", "\x00nul"],
        "none": None,
    }


def container_matrix() -> dict[str, Any]:
    metadata = collections.OrderedDict([("", {"version": 2}), ("sub", {"version": 1})])
    ordered = collections.OrderedDict([("b", torch.ones(3)), ("a", 1), ("sub", collections.OrderedDict(x=2))])
    ordered._metadata = metadata  # type: ignore[attr-defined]
    return {
        "tuple": (1, (2, 3), [4, (5,)], ()),
        "list": [[], [[]], [1, [2, [3, torch.arange(4)]]], ({},)],
        "empty": {"dict": {}, "list": [], "tuple": (), "ordered": collections.OrderedDict()},
        "ordered": ordered,
        "ordered_plain": collections.OrderedDict([("z", 0), ("y", 1)]),
        "keys": {0: "int", -5: "neg", 2.5: "float", None: "none", True: "bool", "a/b": torch.zeros(2),
                 "a~b": torch.ones(2), "": "empty", 10**30: "huge"},
    }


def full_state(float_from_bits: Any, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"torch": torch_matrix(rng), "numpy": numpy_matrix(rng), "python": python_values(float_from_bits),
            "containers": container_matrix(), "top_level_tuple": (torch.arange(3), "x")}


@pytest.fixture(scope="module")
def state_matrix(h: Any) -> dict[str, Any]:
    return full_state(h.float_from_bits)


# ---------------------------------------------------------------------------------------------
# the matrix

@pytest.mark.parametrize("byte_planes", BYTE_PLANES)
@pytest.mark.parametrize("codec", CODECS)
def test_full_state_round_trips_bit_exact(state_matrix: Any, codec: str, byte_planes: str, ckpt_path: Path,
                                          h: Any) -> None:
    config = h.small_config(byte_planes=byte_planes)
    report = gdsckpt.save(state_matrix, ckpt_path, codec=codec, config=config)
    assert report.chunks > 20, "the state should span many small chunks"
    loaded = gdsckpt.load(ckpt_path, config=config)
    h.assert_same(state_matrix, loaded)
    # The file is self-describing: loading with a different configuration gives the same state.
    h.assert_same(state_matrix, gdsckpt.load(ckpt_path))


@pytest.mark.parametrize("codec", CODECS)
def test_chains_follow_codec_and_byte_planes(codec: str, ckpt_path: Path, h: Any) -> None:
    """byte_planes="always" puts byte planes on every compressed multi-byte-float chunk, "never"
    on none; the codec named is the one used wherever compression pays."""
    values = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 0.02
    state = {"w": values, "ints": torch.arange(3000, dtype=torch.int64)}
    expected_codec = {"auto": "zstd", "none": "none"}.get(codec, codec) + "/1"
    for planes in ("always", "never"):
        report = gdsckpt.save(state, ckpt_path, codec=codec, config=h.small_config(byte_planes=planes))
        labels = set(report.chains)
        assert all(label.split("+")[-1] in (expected_codec, "none/1") for label in labels), labels
        uses_planes = any(label.startswith("byteplanes/1") for label in labels)
        if planes == "never" or codec == "none":
            assert not uses_planes, labels
        elif codec == "auto":
            # adaptive: chunks that started while the storage waited are stored as they are;
            # every compressed chunk of the floats has its planes (the int64 chunks have none)
            index = h.read_index(ckpt_path)
            floats = {segment.chunk for record in index.tensors if record.key == "w" for segment in record.segments}
            float_labels = {"+".join(stage["name"] for stage in index.chains[index.chunks[c].chain]) for c in floats}
            assert float_labels <= {"none/1", "byteplanes/1+zstd/1"}, float_labels
        else:
            assert uses_planes, labels
        h.assert_same(state, gdsckpt.load(ckpt_path))


def test_multi_chunk_and_packed_layout(ckpt_path: Path, h: Any) -> None:
    """With 4 KiB chunks a 24 KiB tensor spans 6 chunks, and 100 tiny tensors share few chunks."""
    rng = np.random.default_rng(3)
    state = {"big": random_tensor(torch.float32, (64, 96), rng).t(),
             "tiny": [random_tensor(torch.float32, (5,), rng) for _ in range(100)]}
    gdsckpt.save(state, ckpt_path, codec="none", config=h.small_config())
    index = h.read_index(ckpt_path)
    big = index.tensors[0]
    assert big.key == "big" and len({s.chunk for s in big.segments}) == 6
    tiny_chunks = {s.chunk for t in index.tensors[1:] for s in t.segments}
    assert len(tiny_chunks) == 1, "100 x 20 bytes fit one packed 4 KiB chunk"
    h.assert_same(state, gdsckpt.load(ckpt_path))


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=torch_name)
def test_strided_tensor_whose_last_chunk_holds_one_element(dtype: torch.dtype, ckpt_path: Path, h: Any) -> None:
    """A chunk boundary can leave a single element of a strided view in a chunk of its own."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_chunk = 4096 // itemsize
    base = random_tensor(dtype, (2 * (per_chunk + 1),), np.random.default_rng(itemsize))
    state = {"strided": base[::2], "single": base[1::2][:1], "matrix_column": base.reshape(-1, 2)[:, 1]}
    assert state["strided"].numel() == per_chunk + 1
    gdsckpt.save(state, ckpt_path, config=h.small_config())
    assert max(len(t.segments) for t in h.read_index(ckpt_path).tensors) == 2
    h.assert_same(state, gdsckpt.load(ckpt_path))


def test_state_that_is_a_bare_tensor_or_value(ckpt_path: Path, h: Any) -> None:
    for state in (torch.arange(10), [1, 2], (torch.ones(2),), 5, None, "text", np.float64(1.5)):
        gdsckpt.save(state, ckpt_path, config=h.small_config())
        h.assert_same(state, gdsckpt.load(ckpt_path))


def test_keys_with_empty_and_escaped_components_open_and_load(ckpt_path: Path, h: Any) -> None:
    """Opening a file checks every tensor's key against its place in the structure: empty
    components at the root and below, and components that need escaping ("/", "~"), pass."""
    state = {"": {"": torch.arange(3), "a/b": [torch.ones(2), {"~x": torch.zeros(4)}]},
             "~": (torch.full((2,), 7.0),), "top": torch.eye(2)}
    gdsckpt.save(state, ckpt_path)
    keys = [t.key for t in gdsckpt.inspect(ckpt_path).tensors]
    assert sorted(keys) == sorted(["/", "/a~1b/0", "/a~1b/1/~0x", "~0/0", "top"])
    h.assert_same(state, gdsckpt.load(ckpt_path))


def test_model_and_optimizer_state_dicts_round_trip(ckpt_path: Path, h: Any) -> None:
    from gdsckpt.demo import training_state

    model, optimizer = training_state(width=32, depth=1, steps=2, vocab=64)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 2}
    gdsckpt.save(state, ckpt_path, config=h.small_config())
    loaded = gdsckpt.load(ckpt_path)
    h.assert_same(state, loaded)
    assert loaded["model"]._metadata == state["model"]._metadata
    assert isinstance(loaded["optimizer"]["param_groups"][0]["betas"], tuple)


# ---------------------------------------------------------------------------------------------
# storage sharing

def test_same_tensor_object_twice_comes_back_as_one_object(ckpt_path: Path, h: Any) -> None:
    shared = torch.randn(40, 40)
    parameter = torch.nn.Parameter(torch.randn(8, 8))
    array = np.arange(50.0)
    state = {"a": shared, "b": shared, "nested": [shared, (shared,)], "p1": parameter, "p2": parameter,
             "n1": array, "n2": array}
    gdsckpt.save(state, ckpt_path, config=h.small_config())
    loaded = gdsckpt.load(ckpt_path)
    h.assert_same(state, loaded)
    assert loaded["a"] is loaded["b"] is loaded["nested"][0] is loaded["nested"][1][0]
    assert loaded["p1"] is loaded["p2"] and isinstance(loaded["p1"], torch.nn.Parameter)
    assert loaded["n1"] is loaded["n2"]
    info = {t.key: t for t in gdsckpt.inspect(ckpt_path).tensors}
    assert info["b"].alias_of == "a" and info["b"].stored_bytes == 0
    assert info["p2"].alias_of == "p1" and info["n2"].alias_of == "n1"


def test_tied_weights_in_a_state_dict_are_stored_once(ckpt_path: Path, h: Any) -> None:
    from gdsckpt.demo import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, width=32, depth=1)
    model.head.weight = model.embed.weight
    state = model.state_dict()  # two distinct detached tensors that are the very same view
    assert state["head.weight"] is not state["embed.weight"]
    gdsckpt.save(state, ckpt_path, config=h.small_config())
    loaded = gdsckpt.load(ckpt_path)
    h.assert_same(state, loaded)
    assert loaded["head.weight"] is loaded["embed.weight"]
    untied = TinyGPT(vocab=64, width=32, depth=1).state_dict()
    gdsckpt.save(untied, ckpt_path.with_name("untied.gdsckpt"), config=h.small_config())
    tied_info = gdsckpt.inspect(ckpt_path)
    untied_info = gdsckpt.inspect(ckpt_path.with_name("untied.gdsckpt"))
    assert tied_info.logical_bytes == untied_info.logical_bytes - state["head.weight"].nbytes


def test_overlapping_views_come_back_as_independent_correct_copies(ckpt_path: Path, h: Any) -> None:
    base = torch.randn(100, generator=torch.Generator().manual_seed(2))
    state = {
        "base": base,
        "head": base[:60],
        "tail": base[40:],
        "same_start_shorter": base[:50],
        "strided": base[::2],
        "as_int": base.view(torch.int32),
        "matrix": base.view(10, 10),
        "matrix_t": base.view(10, 10).t(),
    }
    gdsckpt.save(state, ckpt_path, config=h.small_config())
    loaded = gdsckpt.load(ckpt_path)
    h.assert_same(state, loaded)
    pointers = [t.untyped_storage().data_ptr() for t in loaded.values()]
    assert len(set(pointers)) == len(pointers), "overlapping views must not share memory once loaded"
    loaded["head"].fill_(7.0)
    for key in ("base", "tail", "same_start_shorter", "strided", "as_int", "matrix", "matrix_t"):
        assert h.tensor_bytes(loaded[key]) == h.tensor_bytes(state[key]), key
    assert all(t.alias_of is None for t in gdsckpt.inspect(ckpt_path).tensors)


def test_parameter_and_its_detached_view_keep_their_types(ckpt_path: Path, h: Any) -> None:
    """Same storage, same view, different types: each entry comes back as the type it was."""
    parameter = torch.nn.Parameter(torch.randn(6, 6))
    frozen = torch.nn.Parameter(parameter.detach(), requires_grad=False)
    state = {"param": parameter, "plain": parameter.detach(), "frozen": frozen}
    gdsckpt.save(state, ckpt_path, config=h.small_config())
    loaded = gdsckpt.load(ckpt_path)
    h.assert_same(state, loaded)
    assert loaded["param"].requires_grad and not loaded["frozen"].requires_grad
    assert not loaded["plain"].requires_grad


def test_conjugate_and_negative_views_round_trip_resolved(ckpt_path: Path, h: Any) -> None:
    """Lazy conjugate / negative views share their base's memory, view and dtype, but not its
    values: they must be saved as what they read as, never as an alias of the base."""
    x = torch.randn(6, 5, dtype=torch.complex64, generator=torch.Generator().manual_seed(4))
    state = {"x": x, "conj": x.conj(), "conj_t": x.conj().t(), "neg_imag": x.conj().imag, "imag": x.imag}
    assert state["conj"].is_conj() and state["neg_imag"].is_neg()
    gdsckpt.save(state, ckpt_path, config=h.small_config())
    loaded = gdsckpt.load(ckpt_path)
    for key, value in state.items():
        resolved = value.resolve_conj().resolve_neg()
        assert not loaded[key].is_conj() and not loaded[key].is_neg(), key
        assert h.tensor_bytes(loaded[key]) == h.tensor_bytes(resolved), key
    assert loaded["conj"] is not loaded["x"] and loaded["neg_imag"] is not loaded["imag"]


# ---------------------------------------------------------------------------------------------
# unsupported values

def _unsupported() -> list[Any]:
    return [
        pytest.param(lambda: {1, 2}, id="set"),
        pytest.param(lambda: object(), id="object"),
        pytest.param(lambda: (lambda x: x), id="lambda"),
        pytest.param(lambda: torch.eye(3).to_sparse(), id="sparse"),
        pytest.param(lambda: torch.empty(3, device="meta"), id="meta"),
        pytest.param(lambda: np.array([1, "a"], dtype=object), id="numpy-object"),
        pytest.param(lambda: np.array(["2020-01-01"], dtype="datetime64[D]"), id="numpy-datetime"),
        pytest.param(lambda: b"bytes", id="bytes"),
        pytest.param(lambda: 1 + 2j, id="complex"),
    ]


@pytest.mark.parametrize("make", _unsupported())
def test_unsupported_value_raises_type_error_naming_its_key_path(make: Any, tmp_path: Path, h: Any) -> None:
    path = tmp_path / "bad.gdsckpt"
    state = {"fine": torch.ones(3), "outer": {"inner": [0, make()]}}
    with pytest.raises(TypeError, match="outer/inner/1"):
        gdsckpt.save(state, path, config=h.small_config())
    assert os.listdir(tmp_path) == []


def test_unsupported_dict_key_raises_type_error_naming_its_container(tmp_path: Path, h: Any) -> None:
    with pytest.raises(TypeError, match="outer/mid"):
        gdsckpt.save({"outer": {"mid": {(1, 2): 3}}}, tmp_path / "bad.gdsckpt", config=h.small_config())
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# property test

_PROPERTY_DTYPES = TORCH_DTYPES
_LAYOUTS = ["contiguous", "transposed", "strided", "expanded"]


@st.composite
def _tensor_specs(draw: Any) -> tuple[Any, ...]:
    dtype = draw(st.sampled_from(_PROPERTY_DTYPES))
    ndim = draw(st.integers(0, 3))
    limit = {0: 1, 1: 3000, 2: 60, 3: 14}[ndim]
    shape = tuple(draw(st.lists(st.integers(0, limit), min_size=ndim, max_size=ndim)))
    layout = draw(st.sampled_from(_LAYOUTS)) if ndim else "contiguous"
    kind = draw(st.sampled_from(["torch", "numpy"])) if torch_name(dtype) in NUMPY_DTYPES else "torch"
    return dtype, shape, layout, kind


def _build(spec: tuple[Any, ...], rng: np.random.Generator) -> Any:
    dtype, shape, layout, kind = spec
    if layout == "transposed":
        tensor = random_tensor(dtype, tuple(reversed(shape)), rng).permute(*reversed(range(len(shape))))
    elif layout == "strided":
        tensor = random_tensor(dtype, (shape[0] * 2 + 1,) + shape[1:], rng)[1::2]
    elif layout == "expanded":
        tensor = random_tensor(dtype, (1,) + shape[1:], rng).expand(*shape)
    else:
        tensor = random_tensor(dtype, shape, rng)
    assert tuple(tensor.shape) == shape
    return tensor.numpy() if kind == "numpy" else tensor


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(_tensor_specs(), min_size=1, max_size=5),
       seed=st.integers(0, 2**32 - 1),
       chunk_bytes=st.sampled_from([4096, 8192, 12288]),
       pack_below=st.sampled_from([0, 512, 4096, 1 << 20]),
       codec=st.sampled_from(CODECS),
       byte_planes=st.sampled_from(BYTE_PLANES),
       alias=st.booleans())
def test_random_tensors_round_trip_bit_exact(specs: list[Any], seed: int, chunk_bytes: int, pack_below: int,
                                             codec: str, byte_planes: str, alias: bool, h: Any) -> None:
    rng = np.random.default_rng(seed)
    values = [_build(spec, rng) for spec in specs]
    state: dict[str, Any] = {f"t{i}": value for i, value in enumerate(values)}
    if alias:
        state["again"] = values[0]
    config = h.small_config(chunk_bytes=chunk_bytes, pack_below=pack_below, byte_planes=byte_planes)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prop.gdsckpt"
        gdsckpt.save(state, path, codec=codec, config=config)
        loaded = gdsckpt.load(path)
        h.assert_same(state, loaded)
        if alias and np.prod(np.shape(values[0])) > 0:
            assert loaded["again"] is loaded["t0"]
        gdsckpt.verify(path)
        for chunk in h.read_index(path).chunks:
            assert chunk.raw <= chunk_bytes


def test_every_codec_and_plane_combination_is_listed() -> None:
    """Guard: the matrix above covers every codec the library offers on the CPU."""
    from gdsckpt.codecs import PORTABLE_CODECS

    assert set(CODECS) == set(PORTABLE_CODECS) | {"auto"}
    assert set(BYTE_PLANES) == {"always", "never", "auto"}
