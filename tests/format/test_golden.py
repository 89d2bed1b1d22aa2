"""Golden files of format v1: the writer still produces them, the reader still reads them, and their
bytes match docs/format.md field by field (parsed with ``struct``, not with the library).

``tests/data/golden_v1_none.gdsckpt`` stores raw bytes (codec ``none``), so its content is a
function of the state and the format alone; any change to the header, the trailer, the chunk
layout, the planning or the index encoding changes it and fails ``test_save_reproduces_golden``
or ``test_golden_fingerprint``. ``golden_v1_zstd.gdsckpt`` (byte planes + zstd) is read-only:
compressed bytes may differ between zstd versions, so it is only loaded.
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from . import spec

torch = pytest.importorskip("torch")

DATA = Path(__file__).resolve().parent.parent / "data"
GOLDEN_NONE = DATA / "golden_v1_none.gdsckpt"
GOLDEN_ZSTD = DATA / "golden_v1_zstd.gdsckpt"

GOLDEN_NONE_FINGERPRINT = "01a1dca569047c5d0ceea09b48891bc3a55cf80e8814b6a827591422396611d8"
"""sha256 of golden_v1_none's bytes before the index, followed by its index re-serialised
compactly with ``writer`` set to "". Changing it means format v1 changed: it must not."""


def _make_golden() -> Any:
    spec_ = importlib.util.spec_from_file_location("gdsckpt_make_golden", DATA / "make_golden.py")
    assert spec_ is not None and spec_.loader is not None
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    return module


make_golden = _make_golden()


def _compact(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _normalised(data: bytes) -> bytes:
    """The file without its trailer, the index re-serialised with ``writer`` blanked."""
    trailer = spec.parse_trailer(data)
    start, length = trailer["index_offset"], trailer["index_length"]
    doc = json.loads(data[start:start + length])
    doc["writer"] = ""
    return data[:start] + _compact(doc)


# ---------------------------------------------------------------------------------------------
# the checksum

def test_crc32c_definition() -> None:
    from gdsckpt.format import CHECKSUM_ALGORITHM, checksum

    assert CHECKSUM_ALGORITHM == "crc32c"
    assert spec.crc32c_pure(b"123456789") == 0xE3069283  # the catalogued check value
    assert spec.crc32c_fast(b"123456789") == 0xE3069283
    assert checksum(b"123456789") == 0xE3069283
    assert spec.crc32c_pure(b"") == checksum(b"") == 0
    data = bytes(range(256)) * 5 + b"\x00" * 77
    assert spec.crc32c_pure(data) == checksum(data) == spec.crc32c_fast(data)
    assert checksum(data[100:], checksum(data[:100])) == checksum(data)  # continuation
    assert spec.crc32c_pure(data[100:], spec.crc32c_pure(data[:100])) == checksum(data)


@pytest.mark.parametrize("cut", [0, 1, 4095, 4096, 10_000, 65_536])
def test_crc32c_block_combine(cut: int) -> None:
    """docs/format.md: a GPU checksums blocks independently and combines them (GF(2) combine)."""
    from gdsckpt.format import checksum

    data = (np.arange(70_001, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8).tobytes()
    a, b = data[:cut], data[cut:]
    assert spec.crc32c_combine(checksum(a), checksum(b), len(b)) == checksum(data)
    blocks = [data[i:i + 16_384] for i in range(0, len(data), 16_384)]
    combined = checksum(blocks[0])
    for block in blocks[1:]:
        combined = spec.crc32c_combine(combined, checksum(block), len(block))
    assert combined == checksum(data)


# ---------------------------------------------------------------------------------------------
# (a) the writer reproduces golden_v1_none

def test_golden_fingerprint() -> None:
    data = GOLDEN_NONE.read_bytes()
    assert hashlib.sha256(_normalised(data)).hexdigest() == GOLDEN_NONE_FINGERPRINT


def test_golden_index_is_canonical_json() -> None:
    """The writer's index serialisation: compact separators, fixed key order, UTF-8 unescaped."""
    for path in (GOLDEN_NONE, GOLDEN_ZSTD):
        parsed = spec.parse_file(path.read_bytes())
        assert _compact(parsed.index) == parsed.index_bytes
        assert list(parsed.index) == ["format", "version", "writer", "checksum", "alignment", "chains",
                                      "chunks", "tensors", "tree"]
        assert "\\u" not in parsed.index_bytes.decode("utf-8")  # non-ASCII text stored as UTF-8


def test_save_reproduces_golden(tmp_path: Path) -> None:
    """Saving the golden state today gives golden_v1_none's bytes, the writer string aside."""
    import gdsckpt

    target = tmp_path / "today.gdsckpt"
    make_golden.write_golden("golden_v1_none.gdsckpt", target)
    today, golden = target.read_bytes(), GOLDEN_NONE.read_bytes()
    t_today, t_golden = spec.parse_trailer(today), spec.parse_trailer(golden)
    assert t_today["index_offset"] == t_golden["index_offset"]
    offset = t_golden["index_offset"]
    assert today[:offset] == golden[:offset], "header or chunk bytes changed"
    assert _normalised(today) == _normalised(golden), "index changed (beyond the writer field)"
    index_today = json.loads(today[offset:offset + t_today["index_length"]])
    assert index_today["writer"] == f"gdsckpt {gdsckpt.__version__}"
    if index_today["writer"] == json.loads(golden[offset:offset + t_golden["index_length"]])["writer"]:
        assert today == golden
    else:  # another version string: same bytes once the writer field is swapped back
        index_today["writer"] = json.loads(golden[offset:offset + t_golden["index_length"]])["writer"]
        raw = _compact(index_today)
        assert today[:offset] + raw + spec.pack_trailer(offset, raw) == golden


def test_save_is_independent_of_thread_count(tmp_path: Path) -> None:
    """Layout is a function of state and options, never of thread timing."""
    import gdsckpt

    config = make_golden.config_for("golden_v1_none.gdsckpt").replace(codec_threads=7, io_threads=5,
                                                                       max_inflight_bytes=8192)
    gdsckpt.save(make_golden.build_state(), tmp_path / "x.gdsckpt", config=config)
    assert _normalised((tmp_path / "x.gdsckpt").read_bytes()) == _normalised(GOLDEN_NONE.read_bytes())


# ---------------------------------------------------------------------------------------------
# (b) the reader reads both goldens bit-exactly

def _tensor_bytes(tensor: Any) -> bytes:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def assert_same(expected: Any, actual: Any, where: str = "<root>") -> None:
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert (actual.dtype, tuple(actual.shape)) == (expected.dtype, tuple(expected.shape)), where
        assert actual.device.type == "cpu", where
        assert actual.requires_grad == expected.requires_grad, where
        assert _tensor_bytes(actual) == _tensor_bytes(expected), f"{where}: bits differ"
    elif isinstance(expected, (np.ndarray, np.generic)):
        assert actual.dtype == expected.dtype and np.shape(actual) == np.shape(expected), where
        assert np.asarray(actual).tobytes() == np.asarray(expected).tobytes(), f"{where}: bits differ"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for (k_expected, v_expected), k_actual in zip(expected.items(), actual):
            assert type(k_actual) is type(k_expected), f"{where}: key {k_expected!r}"
            assert_same(v_expected, actual[k_actual], f"{where}/{k_expected}")
        if isinstance(expected, collections.OrderedDict):
            assert hasattr(actual, "_metadata") == hasattr(expected, "_metadata"), where
            if hasattr(expected, "_metadata"):
                assert_same(expected._metadata, actual._metadata, f"{where}/_metadata")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{where}/{i}")
    elif isinstance(expected, float):
        assert struct.pack("<d", actual) == struct.pack("<d", expected), f"{where}: {actual!r}"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


@pytest.mark.parametrize("path", [GOLDEN_NONE, GOLDEN_ZSTD], ids=["none", "zstd"])
def test_golden_loads_bit_exact(path: Path) -> None:
    import gdsckpt

    expected = make_golden.build_state()
    state = gdsckpt.load(path)
    assert_same(expected, state)
    model = state["model"]
    assert model["head.weight"] is model["embed.weight"], "an alias comes back as the same object"
    assert isinstance(model["embed.weight"], torch.nn.Parameter)
    assert model["embed.weight"].requires_grad and not model["layer.0.weight"].requires_grad
    assert gdsckpt.verify(path).chunks == 9


def test_zstd_golden_uses_byte_planes_and_zstd() -> None:
    doc = spec.parse_file(GOLDEN_ZSTD.read_bytes()).index
    names = [[stage["name"] for stage in chain] for chain in doc["chains"]]
    assert ["byteplanes/1", "zstd/1"] in names
    widths = {stage["width"] for chain in doc["chains"] for stage in chain if stage["name"] == "byteplanes/1"}
    assert widths <= {2, 4, 8} and 2 in widths  # bfloat16 / float16 planes of width 2
    for chain in doc["chains"]:  # stage objects hold their fields in sorted order
        for stage in chain:
            assert list(stage) == sorted(stage)


def test_planning_does_not_depend_on_codec() -> None:
    """Both goldens: same chunks (raw sizes), same segments; only chains and stored bytes differ."""
    none = spec.parse_file(GOLDEN_NONE.read_bytes()).index
    zstd = spec.parse_file(GOLDEN_ZSTD.read_bytes()).index
    assert [c[2] for c in none["chunks"]] == [c[2] for c in zstd["chunks"]]
    assert none["tensors"] == zstd["tensors"]
    assert none["tree"] == zstd["tree"]


@pytest.mark.parametrize("path", [GOLDEN_NONE, GOLDEN_ZSTD], ids=["none", "zstd"])
def test_spec_reader_decodes_golden(path: Path) -> None:
    """The independent reader of tests/format/spec.py (written from docs/format.md: byte planes,
    segments, aliases) recovers every tensor's bytes, and the tree's key paths and plain values."""
    data = path.read_bytes()
    doc = spec.parse_file(data).index
    got = spec.tensor_bytes(data, doc)
    expected = _expected_arrays(make_golden.build_state())
    assert got == expected
    assert spec.violations(doc, spec.parse_trailer(data)["index_offset"]) == []
    paths = spec.tensor_paths(doc["tree"])
    assert [paths[i] for i in range(len(doc["tensors"]))] == [t["key"] for t in doc["tensors"]]
    plain = spec.plain_values(doc["tree"])
    assert plain["plain/0"] == 2 ** 100 and plain["plain/1"] == -(2 ** 70) + 1
    assert struct.pack(">d", plain["plain/3"]).hex() == "8000000000000000"  # -0.0
    assert plain["plain/7"] != plain["plain/7"]  # nan
    assert plain["plain/11"] == "h\u00e9llo \u2713 \U0001d11e"
    assert plain["keys/-7"] == "negative int key" and plain["keys/True"] is None and plain["keys/None"] == 0
    assert plain["optimizer/param_groups/0/betas/1"] == 0.999


def _expected_arrays(state: Any) -> dict[str, bytes]:
    """key path -> element bytes of every array in the golden state, computed with torch/NumPy."""
    out: dict[str, bytes] = {}

    def walk(obj: Any, path: list[str]) -> None:
        if isinstance(obj, torch.Tensor):
            out["/".join(path)] = _tensor_bytes(obj)
        elif isinstance(obj, (np.ndarray, np.generic)):
            array = np.asarray(obj)
            out["/".join(path)] = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, path + [spec.key_component(key)])
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                walk(value, path + [str(i)])

    walk(state, [])
    return out


# ---------------------------------------------------------------------------------------------
# (c) header, trailer and layout, field by field

@pytest.mark.parametrize("path", [GOLDEN_NONE, GOLDEN_ZSTD], ids=["none", "zstd"])
def test_golden_header_fields(path: Path) -> None:
    data = path.read_bytes()
    assert data[0:8] == b"\x93GDSCKPT"
    assert struct.unpack_from("<H", data, 8)[0] == 1        # major
    assert struct.unpack_from("<H", data, 10)[0] == 0       # minor
    assert struct.unpack_from("<I", data, 12)[0] == 4096    # header region
    assert struct.unpack_from("<I", data, 16)[0] == 4096    # alignment
    assert struct.unpack_from("<I", data, 20)[0] == 0       # flags
    assert data[24:60] == bytes(36)                          # reserved
    assert struct.unpack_from("<I", data, 60)[0] == spec.crc32c_pure(data[0:60])
    assert data[64:4096] == bytes(4032)                      # rest of the header region


@pytest.mark.parametrize("path", [GOLDEN_NONE, GOLDEN_ZSTD], ids=["none", "zstd"])
def test_golden_trailer_fields(path: Path) -> None:
    data = path.read_bytes()
    t = data[-64:]
    assert t[0:8] == b"GDSCKIDX"
    assert struct.unpack_from("<H", t, 8)[0] == 1            # major
    assert struct.unpack_from("<H", t, 10)[0] == 0           # minor
    assert struct.unpack_from("<I", t, 12)[0] == 0           # flags
    index_offset = struct.unpack_from("<Q", t, 16)[0]
    index_length = struct.unpack_from("<Q", t, 24)[0]
    index_crc = struct.unpack_from("<I", t, 32)[0]
    assert struct.unpack_from("<I", t, 36)[0] == 0           # reserved
    file_length = struct.unpack_from("<Q", t, 40)[0]
    assert t[48:60] == bytes(12)                             # reserved
    assert struct.unpack_from("<I", t, 60)[0] == spec.crc32c_pure(t[0:60])
    assert file_length == len(data) == index_offset + index_length + 64
    assert index_offset % 4096 == 0
    assert index_crc == spec.crc32c_pure(data[index_offset:index_offset + index_length])


@pytest.mark.parametrize("path", [GOLDEN_NONE, GOLDEN_ZSTD], ids=["none", "zstd"])
def test_golden_chunk_layout(path: Path) -> None:
    """Chunks start at 4096 and follow each other at aligned offsets, zero padded, checksummed over
    their stored bytes; the index starts right after the last padded chunk."""
    data = path.read_bytes()
    parsed = spec.parse_file(data)
    position = 4096
    for offset, stored, raw, crc, chain in parsed.index["chunks"]:
        assert offset == position
        assert spec.crc32c_fast(data[offset:offset + stored]) == crc
        padded = spec.align_up(stored)
        assert data[offset + stored:offset + padded] == bytes(padded - stored)
        if parsed.index["chains"][chain] == [{"name": "none/1"}]:
            assert stored == raw
        position = offset + padded
    assert parsed.trailer["index_offset"] == position


def test_golden_index_records() -> None:
    doc = spec.parse_file(GOLDEN_NONE.read_bytes()).index
    assert doc["format"] == "gdsckpt" and doc["version"] == [1, 0] and doc["checksum"] == "crc32c"
    assert doc["alignment"] == 4096 and doc["chains"] == [[{"name": "none/1"}]]
    by_key = {t["key"]: t for t in doc["tensors"]}
    assert list(by_key["model/embed.weight"]) == ["key", "kind", "dtype", "shape", "device", "segments",
                                                  "parameter"]
    assert by_key["model/embed.weight"]["segments"] == [[0, 0, 8192], [1, 0, 4096]]
    assert by_key["model/embed.weight"]["parameter"] == {"requires_grad": True}
    assert by_key["model/head.weight"] == {"key": "model/head.weight", "kind": "torch", "dtype": "bfloat16",
                                           "shape": [64, 96], "device": "cpu", "alias": 0,
                                           "parameter": {"requires_grad": True}}
    assert by_key["misc/empty"]["segments"] == [] and by_key["misc/step"]["shape"] == []
    assert by_key["arrays/count"]["scalar"] is True and by_key["arrays/count"]["kind"] == "numpy"
    assert by_key["misc/transposed"]["shape"] == [5, 3]
    assert "keys/a~1b~0c" in by_key and "keys/2.5" in by_key
    model = doc["tree"]["items"][0][1]
    assert model["cls"] == "OrderedDict" and model["meta"]["t"] == "dict"
    # packs: widths 0, 2, 4, 8 in that order after the arrays with chunks of their own
    assert [c[2] for c in doc["chunks"]] == [8192, 4096, 8192, 2048, 8192, 246, 110, 968, 152]


def test_golden_sizes_within_bounds() -> None:
    for path in (GOLDEN_NONE, GOLDEN_ZSTD):
        assert 20 * 1024 <= os.path.getsize(path) <= 60 * 1024


def test_dtype_table_matches_spec() -> None:
    from gdsckpt.format import DTYPES

    assert {name: (s.itemsize, s.plane_width) for name, s in DTYPES.items()} == spec.DTYPES


@pytest.mark.parametrize("width", [2, 4, 8])
def test_byteplanes_definition(width: int) -> None:
    """The library's transform is the spec's: most significant byte plane first."""
    from gdsckpt.codecs import BYTE_PLANES

    data = bytes((i * 37 + 11) % 256 for i in range(width * 10))
    forward = BYTE_PLANES.forward(np.frombuffer(data, dtype=np.uint8), {"width": width}).tobytes()
    assert forward == spec.byteplanes_forward(data, width)
    assert forward[:10] == bytes(data[i * width + width - 1] for i in range(10))  # top bytes first
    assert BYTE_PLANES.inverse(np.frombuffer(forward, dtype=np.uint8), {"width": width}).tobytes() == data
    assert spec.byteplanes_inverse(forward, width) == data


@pytest.mark.parametrize("name", ["zstd", "lz4", "deflate", "none"])
def test_codec_bitstreams(name: str) -> None:
    """Each portable codec writes the bitstream the spec names, readable by the reference library."""
    from gdsckpt.codecs import host_codec, versioned_name

    data = bytes(range(256)) * 40 + bytes(1000)
    stored = bytes(memoryview(host_codec(name).encode(np.frombuffer(data, dtype=np.uint8))).cast("B"))
    assert spec.decode_stage(versioned_name(name), stored, len(data)) == data
    if name == "zstd":
        assert stored[:4] == b"\x28\xb5\x2f\xfd"  # one zstd frame
    if name == "lz4":
        assert len(stored) != len(data) and stored[:4] != len(data).to_bytes(4, "little")  # no size prefix


def test_make_golden_main_writes_both_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert make_golden.main(["make_golden.py", str(tmp_path)]) == 0
    assert "golden_v1_zstd.gdsckpt" in capsys.readouterr().out
    written = (tmp_path / "golden_v1_none.gdsckpt").read_bytes()
    assert _normalised(written) == _normalised(GOLDEN_NONE.read_bytes())
    import gdsckpt

    assert_same(make_golden.build_state(), gdsckpt.load(tmp_path / "golden_v1_zstd.gdsckpt"))
