"""Hostile files: the index parser validates everything before a reader allocates anything.

Every rule of docs/format.md "Invariants" has a case here; hypothesis mutates a real index (the
golden file's) and feeds random bytes, and only ``CheckpointError`` subclasses may escape. When a
mutated index is accepted, tests/format/spec.py's independent checker must find it valid too, so
the parser is never more lenient than the spec.
"""

from __future__ import annotations

import copy
import json
import traceback
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gdsckpt
from gdsckpt.errors import (
    CheckpointError,
    CodecUnavailableError,
    CorruptCheckpointError,
    UnsupportedFormatError,
)
from gdsckpt.format import Index, parse_index

from . import spec

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "golden_v1_none.gdsckpt"
GOLDEN_BYTES = GOLDEN.read_bytes()
GOLDEN_TRAILER = spec.parse_trailer(GOLDEN_BYTES)
GOLDEN_OFFSET = GOLDEN_TRAILER["index_offset"]
GOLDEN_INDEX = GOLDEN_BYTES[GOLDEN_OFFSET:GOLDEN_OFFSET + GOLDEN_TRAILER["index_length"]]
GOLDEN_DOC = json.loads(GOLDEN_INDEX)

FUZZ = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def parse(doc: Any, index_offset: int = GOLDEN_OFFSET) -> Index:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc, separators=(",", ":")).encode("utf-8")
    return parse_index(raw, index_offset=index_offset)


def golden() -> dict[str, Any]:
    return copy.deepcopy(GOLDEN_DOC)


def tiny() -> dict[str, Any]:
    """A minimal valid index: one 16-byte chunk at 4096 holding tensors "a" (int64[1]) and
    "b" (uint8[8]); index_offset 8192."""
    return {
        "format": "gdsckpt", "version": [1, 0], "writer": "test", "checksum": "crc32c", "alignment": 4096,
        "chains": [[{"name": "none/1"}]],
        "chunks": [[4096, 16, 16, 0, 0]],
        "tensors": [
            {"key": "a", "kind": "torch", "dtype": "int64", "shape": [1], "device": "cpu",
             "segments": [[0, 0, 8]]},
            {"key": "b", "kind": "torch", "dtype": "uint8", "shape": [8], "device": "cpu",
             "segments": [[0, 8, 8]]},
        ],
        "tree": {"t": "dict", "items": [[{"t": "str", "v": "a"}, {"t": "tensor", "id": 0}],
                                        [{"t": "str", "v": "b"}, {"t": "tensor", "id": 1}]]},
    }


def test_valid_documents_parse() -> None:
    index = parse(golden())
    assert len(index.chunks) == 9 and len(index.tensors) == 24 and index.minor == 0
    assert parse(tiny(), 8192).tensors[1].segments[0].raw_offset == 8
    assert parse(GOLDEN_INDEX).writer == "gdsckpt 0.1.0"


# ---------------------------------------------------------------------------------------------
# one case per rule

def edit(fn: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    doc = tiny()
    fn(doc)
    return doc


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        target = doc
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value
    return apply


def _delete(path: list[Any]) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        target = doc
        for part in path[:-1]:
            target = target[part]
        del target[path[-1]]
    return apply


def _two_chunks(doc: dict[str, Any]) -> None:
    """Split tiny()'s chunk in two (a in chunk 0 at 4096, b in chunk 1 at 8192); index at 12288."""
    doc["chunks"] = [[4096, 8, 8, 0, 0], [8192, 8, 8, 0, 0]]
    doc["tensors"][1]["segments"] = [[1, 0, 8]]


def _alias_b(doc: dict[str, Any], target: int = 0) -> None:
    doc["tensors"][1] = {"key": "b", "kind": "torch", "dtype": "int64", "shape": [1], "device": "cpu",
                         "alias": target}
    doc["chunks"][0][1:3] = [8, 8]


CORRUPT: dict[str, Callable[[dict[str, Any]], Any]] = {
    # top level
    "format name": _set(["format"], "gdsckpt2"),
    "version not a pair": _set(["version"], [1]),
    "version bool": _set(["version"], [True, 0]),
    "checksum algorithm": _set(["checksum"], "xxhash64"),
    "alignment": _set(["alignment"], 512),
    "user not an object": _set(["user"], [1]),
    "chains missing": _delete(["chains"]),
    "tree missing": _delete(["tree"]),
    # chains
    "empty chain": _set(["chains"], [[]]),
    "stage without name": _set(["chains", 0, 0], {"width": 2}),
    "unversioned stage name": _set(["chains", 0, 0, "name"], "zstd"),
    "stage name with newline": _set(["chains", 0, 0, "name"], "none/1\n"),
    "stage name upper case": _set(["chains", 0, 0, "name"], "ZSTD/1"),
    # chunks
    "chunk record short": _set(["chunks", 0], [4096, 16, 16, 0]),
    "chunk in header region": _set(["chunks", 0, 0], 0),
    "chunk unaligned": _set(["chunks", 0, 0], 4097),
    "chunk past index": _set(["chunks", 0, 0], 8192),
    "chunk negative length": _set(["chunks", 0, 1], -1),
    "chunk crc out of range": _set(["chunks", 0, 3], 1 << 32),
    "chunk chain out of range": _set(["chunks", 0, 4], 1),
    "chunk offset bool": _set(["chunks", 0, 4], False),
    "chunk offset float": _set(["chunks", 0, 0], 4096.0),
    "chunk raw over 1 GiB": lambda d: d["chunks"].__setitem__(0, [4096, 4096, (1 << 30) + 1, 0, 0]),
    "chunk expansion over 65536": _set(["chunks", 0, 2], 16 * 65536 + 1),
    "chunk stored 0 raw > 0": _set(["chunks", 0, 1], 0),
    "chunks overlap": lambda d: (_two_chunks(d), d["chunks"][1].__setitem__(0, 4096)),
    "chunks descend": lambda d: (_two_chunks(d), d["chunks"].reverse(),
                                 d["tensors"][0].__setitem__("segments", [[1, 0, 8]]),
                                 d["tensors"][1].__setitem__("segments", [[0, 0, 8]])),
    # tensors
    "tensors not a list": _set(["tensors"], {}),
    "duplicate key": _set(["tensors", 1, "key"], "a"),
    "key not a string": _set(["tensors", 1, "key"], 1),
    "unknown kind": _set(["tensors", 0, "kind"], "tensorflow"),
    "unknown dtype": _set(["tensors", 0, "dtype"], "float128"),
    "dtype is a list": _set(["tensors", 0, "dtype"], ["int64"]),
    "dtype is an object": _set(["tensors", 0, "dtype"], {"name": "int64"}),
    "shape not a list": _set(["tensors", 0, "shape"], 1),
    "shape negative": _set(["tensors", 0, "shape"], [-1]),
    "shape over 64 dims": _set(["tensors", 0, "shape"], [1] * 65),
    "tensor over 2**60 bytes": _set(["tensors", 0, "shape"], [1 << 30, 1 << 30]),
    "device not a string": _set(["tensors", 0, "device"], 0),
    "segments missing": _delete(["tensors", 0, "segments"]),
    "segment record short": _set(["tensors", 0, "segments"], [[0, 0]]),
    "segment chunk out of range": _set(["tensors", 0, "segments"], [[1, 0, 8]]),
    "segment runs past chunk": _set(["tensors", 1, "segments"], [[0, 9, 8]]),
    "segment length 0": _set(["tensors", 0, "segments"], [[0, 0, 8], [0, 8, 0]]),
    "segments short of shape": _set(["tensors", 1, "shape"], [9]),
    "segments longer than shape": _set(["tensors", 1, "shape"], [7]),
    "hole in chunk": lambda d: (d["chunks"][0].__setitem__(2, 24), d["chunks"][0].__setitem__(1, 24)),
    "bytes referenced twice": _set(["tensors", 1, "segments"], [[0, 0, 8]]),
    "overlapping segments": lambda d: (d["tensors"][1].__setitem__("segments", [[0, 4, 8]]),
                                       d["chunks"][0].__setitem__(2, 12), d["chunks"][0].__setitem__(1, 12)),
    "chunk referenced by nobody": lambda d: (_two_chunks(d), d["chunks"].__setitem__(0, [4096, 16, 16, 0, 0]),
                                             d["tensors"][1].__setitem__("segments", [[0, 8, 8]])),
    # aliases
    "alias to itself": lambda d: (_alias_b(d), d["tensors"][1].__setitem__("alias", 1)),
    "alias to a later tensor": lambda d: (_alias_b(d), d["tensors"].reverse(), d["tree"]["items"].reverse(),
                                          d["tensors"][0].__setitem__("alias", 1)),
    "alias to an alias": lambda d: (_alias_b(d), d["tensors"].append(dict(d["tensors"][1], key="c", alias=1)),
                                    d["tree"]["items"].append([{"t": "str", "v": "c"},
                                                               {"t": "tensor", "id": 2}])),
    "alias of another dtype": lambda d: (_alias_b(d), d["tensors"][1].__setitem__("dtype", "float64")),
    "alias of another shape": lambda d: (_alias_b(d), d["tensors"][1].__setitem__("shape", [1, 1])),
    "alias out of range": lambda d: (_alias_b(d), d["tensors"][1].__setitem__("alias", 7)),
    "alias negative": lambda d: (_alias_b(d), d["tensors"][1].__setitem__("alias", -1)),
    "alias and segments": lambda d: (_alias_b(d), d["tensors"][1].__setitem__("segments", [])),
    # tree
    "tree not an object": _set(["tree"], []),
    "unknown node type": _set(["tree", "t"], "set"),
    "node type not a string": _set(["tree", "t"], ["dict"]),
    "items not a list": _set(["tree", "items"], {}),
    "dict item not a pair": _set(["tree", "items", 0], [{"t": "str", "v": "a"}]),
    "dict key a tensor": _set(["tree", "items", 0, 0], {"t": "tensor", "id": 0}),
    "dict key a list": _set(["tree", "items", 0, 0], {"t": "list", "items": []}),
    "dict key type a list": _set(["tree", "items", 0, 0], {"t": ["str"], "v": "a"}),
    "tensor referenced twice": _set(["tree", "items", 1, 1], {"t": "tensor", "id": 0}),
    "tensor not referenced": _set(["tree", "items", 1, 1], {"t": "none"}),
    "tensor id out of range": _set(["tree", "items", 1, 1], {"t": "tensor", "id": 2}),
    "tensor id a string": _set(["tree", "items", 1, 1], {"t": "tensor", "id": "1"}),
    "tensor in meta": lambda d: (d["tree"].__setitem__("cls", "OrderedDict"),
                                 d["tree"].__setitem__("meta", d["tree"]["items"].pop(1)[1]),
                                 d["tree"]["items"].append([{"t": "str", "v": "b"}, {"t": "none"}])),
    "int as JSON number": _set(["tree", "items", 1], [{"t": "str", "v": "x"}, {"t": "int", "v": 5}]),
    "int with plus sign": _set(["tree", "items", 0, 0], {"t": "int", "v": "+5"}),
    "int with spaces": _set(["tree", "items", 0, 0], {"t": "int", "v": " 5"}),
    "int in hex": _set(["tree", "items", 0, 0], {"t": "int", "v": "0x5"}),
    "int with 4301 digits": _set(["tree", "items", 0, 0], {"t": "int", "v": "9" * 4301}),
    "int non-ASCII digits": _set(["tree", "items", 0, 0], {"t": "int", "v": "\u0665"}),
    "float upper case hex": _set(["tree", "items", 0, 0], {"t": "float", "v": "3FF0000000000000"}),
    "float 15 digits": _set(["tree", "items", 0, 0], {"t": "float", "v": "3ff000000000000"}),
    "float as JSON number": _set(["tree", "items", 0, 0], {"t": "float", "v": 1.0}),
    "bool as int": _set(["tree", "items", 0, 0], {"t": "bool", "v": 1}),
    "str not a string": _set(["tree", "items", 0, 0], {"t": "str", "v": None}),
}


def _deep_tree(doc: dict[str, Any]) -> None:
    node: dict[str, Any] = {"t": "none"}
    for _ in range(600):
        node = {"t": "list", "items": [node]}
    doc["tree"]["items"].append([{"t": "str", "v": "deep"}, node])


CORRUPT["tree deeper than 512"] = _deep_tree


@pytest.fixture
def deep_stack() -> Any:
    """A recursion limit high enough for JSON nested ~1200 deep (a reader with a bigger stack)."""
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 5000))
    yield
    sys.setrecursionlimit(limit)


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_index_is_rejected(case: str, deep_stack: Any) -> None:
    doc = edit(CORRUPT[case])
    index_offset = 12288 if isinstance(doc.get("chunks"), list) and len(doc["chunks"]) == 2 else 8192
    assert spec.violations(doc, index_offset) != [], "the case must break a rule of the spec"
    with pytest.raises(CorruptCheckpointError) as caught:
        parse(doc, index_offset)
    assert "nesting too deep" not in str(caught.value), "rejected by the rule under test, not the JSON parser"


@pytest.mark.parametrize("raw", [
    b"", b"null", b"[]", b"{}", b"\xff\xfe{}", b"\xef\xbb\xbf{}", b'{"format":"gdsckpt"', b"{" * 10,
    json.dumps(tiny()).encode("utf-16"), json.dumps(tiny()).encode("utf-8-sig"),
    json.dumps(tiny(), separators=(",", ":")).replace("16,", "NaN,", 1).encode(),
    json.dumps(tiny(), separators=(",", ":")).replace('"writer":"test"', '"writer":Infinity').encode(),
    json.dumps(tiny(), separators=(",", ":")).replace('"writer":"test"', '"writer":-Infinity').encode(),
    json.dumps(tiny(), separators=(",", ":")).replace('"test"', '"\xe9"').encode("latin-1"),
    json.dumps(tiny(), separators=(",", ":")).encode()[:-1] + b",}",  # trailing comma
    b"[" * 100_000 + b"]" * 100_000,
    b'{"format":"gdsckpt","version":[1,0],"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    b'{"format":"gdsckpt","version":[1,0],"writer":' + b"9" * 5000 + b"}",
], ids=lambda raw: repr(raw[:24]))
def test_malformed_json_is_rejected(raw: bytes) -> None:
    with pytest.raises(CorruptCheckpointError):
        parse_index(raw, index_offset=8192)


def test_json_nested_100000_deep_is_rejected() -> None:
    doc = json.dumps(tiny(), separators=(",", ":")).encode()
    assert doc.endswith(b"}}") and doc.count(b'"tree":{') == 1
    for deep in (
        doc[:-1] + b',"user":{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}}",            # unused field
        doc.replace(b'"tree":{', b'"tree":{"deep":' + b"[" * 100_000 + b"]" * 100_000 + b",", 1),
        doc.replace(b'"tree":{', b'"tree":' + b'{"t":"list","items":[' * 50_000 + b'{"t":"none"}'
                    + b"]}" * 50_000 + b',"x":{', 1),
    ):
        with pytest.raises(CorruptCheckpointError, match="nesting too deep"):
            parse_index(deep, index_offset=8192)


def test_tree_of_depth_512_parses(deep_stack: Any) -> None:
    doc = tiny()
    node: dict[str, Any] = {"t": "none"}
    for _ in range(510):  # root dict (0) -> 511 tuples (1..511) -> none at depth 512
        node = {"t": "tuple", "items": [node]}
    doc["tree"]["items"].append([{"t": "str", "v": "deep"}, {"t": "tuple", "items": [node]}])
    assert parse(doc, 8192).tree["items"][2][1]["t"] == "tuple"


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_deepest_state_the_writer_makes_loads(tmp_path: Path, kind: str) -> None:
    """256 nested containers (the writer's cap; about 773 levels of JSON) load at the default
    recursion limit, and 257 are refused by the writer."""
    torch = pytest.importorskip("torch")

    def nest(levels: int) -> Any:
        state: Any = torch.arange(3)
        for _ in range(levels):
            state = {"k": state} if kind == "dict" else [state]
        return state

    path = tmp_path / "deep.gdsckpt"
    gdsckpt.save(nest(256), path, config=gdsckpt.Config(fsync=False))
    loaded = gdsckpt.load(path)
    for _ in range(256):
        loaded = loaded["k"] if kind == "dict" else loaded[0]
    assert loaded.tolist() == [0, 1, 2]
    with pytest.raises(TypeError, match="deeper than 256"):
        gdsckpt.save(nest(257), tmp_path / "deeper.gdsckpt", config=gdsckpt.Config(fsync=False))


# ---------------------------------------------------------------------------------------------
# versioning

def test_unknown_major_in_index_is_unsupported() -> None:
    for version in ([2, 0], [0, 9], [999999, 0]):
        doc = golden()
        doc["version"] = version
        doc["chunks"] = "whatever a future major does"
        with pytest.raises(UnsupportedFormatError, match="not supported"):
            parse(doc)


def test_unknown_major_in_header_or_trailer_is_unsupported(tmp_path: Path) -> None:
    path = tmp_path / "future.gdsckpt"
    path.write_bytes(spec.build_file(tiny() | {"chunks": [], "tensors": [], "tree": {"t": "none"}}, major=2))
    with pytest.raises(UnsupportedFormatError):
        gdsckpt.load(path)
    data = spec.build_file({"chunks": []})
    path.write_bytes(data[:4096] + data[4096:-64] + spec.pack_trailer(4096, data[4096:-64], major=3))
    with pytest.raises(UnsupportedFormatError):
        gdsckpt.load(path)
    path.write_bytes(b"PK\x03\x04" + bytes(5000))
    with pytest.raises(UnsupportedFormatError, match="not a gdsckpt"):
        gdsckpt.load(path)


def test_newer_minor_with_unknown_fields_loads(tmp_path: Path) -> None:
    """A minor version adds optional fields: readers ignore the ones they do not know."""
    doc = golden()
    doc["version"] = [1, 7]
    doc["compression_dictionary"] = {"id": 3, "bytes": [1, 2, 3]}
    doc["user"] = {"run": "abc", "step": 12}
    for chain in doc["chains"]:
        chain[-1]["future_parameter"] = [1, {"x": None}]
    for record in doc["tensors"]:
        record["sharding"] = {"mesh": [2, 4], "placement": "replicate"}
        record["stats"] = {"min": -1.5, "max": 2.5}

    def annotate(node: dict[str, Any]) -> None:
        node["annotation"] = {"origin": "future writer"}
        for item in node.get("items", []):
            for child in (item if node["t"] == "dict" else [item]):
                annotate(child)

    annotate(doc["tree"])
    index = parse(doc)
    assert index.minor == 7 and index.user == {"run": "abc", "step": 12}
    assert index.tensors[0].extra["sharding"] == {"mesh": [2, 4], "placement": "replicate"}
    path = tmp_path / "minor7.gdsckpt"
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    path.write_bytes(GOLDEN_BYTES[:GOLDEN_OFFSET] + raw + spec.pack_trailer(GOLDEN_OFFSET, raw, minor=7))
    from .test_golden import assert_same, make_golden

    assert_same(make_golden.build_state(), gdsckpt.load(path))


def _with_chain(tmp_path: Path, name: str) -> Path:
    """The golden file with chunk 5 (the width-0 pack: misc/step, mask, codes, ...) relabelled."""
    doc = golden()
    doc["chains"].append([{"name": name}])
    doc["chunks"][5][4] = 1
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    path = tmp_path / "codec.gdsckpt"
    path.write_bytes(GOLDEN_BYTES[:GOLDEN_OFFSET] + raw + spec.pack_trailer(GOLDEN_OFFSET, raw))
    return path


def test_unknown_codec_fails_on_decode_of_that_chunk_only(tmp_path: Path) -> None:
    path = _with_chain(tmp_path, "brotli/3")
    info = gdsckpt.inspect(path)  # the index alone is fine
    assert info.codecs["brotli/3"] == 1
    with gdsckpt.open(path) as ckpt:
        assert ckpt.get("model/positions").shape == (2048,)  # other chunks decode
        with pytest.raises(UnsupportedFormatError, match="brotli/3"):
            ckpt.get("misc/mask")
    with pytest.raises(UnsupportedFormatError):
        gdsckpt.load(path)


def test_gpu_only_codec_without_gpu_is_unavailable(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from gdsckpt.codecs.nvcomp import gpu_available

    if gpu_available():  # pragma: no cover - a GPU host decodes it (and finds these bytes corrupt)
        pytest.skip("nvCOMP is usable here")
    path = _with_chain(tmp_path, "nvcomp.ans/1")
    with gdsckpt.open(path) as ckpt, pytest.raises(CodecUnavailableError):
        ckpt.get("misc/mask")


# ---------------------------------------------------------------------------------------------
# a small file cannot make the reader allocate a lot

def _terabyte_cases() -> dict[str, dict[str, Any]]:
    tb = 1 << 40

    def one_tensor(shape: list[int], segments: list[list[int]], chunks: list[list[int]], kind: str = "numpy"):
        return {"format": "gdsckpt", "version": [1, 0], "writer": "", "checksum": "crc32c",
                "chains": [[{"name": "none/1"}]], "chunks": chunks,
                "tensors": [{"key": "big", "kind": kind, "dtype": "uint8", "shape": shape, "device": "cpu",
                             "segments": segments}],
                "tree": {"t": "dict", "items": [[{"t": "str", "v": "big"}, {"t": "tensor", "id": 0}]]}}

    gib = 1 << 30
    return {
        # shape says 1 TB, the bytes are 16
        "shape": one_tensor([tb], [[0, 0, 16]], [[4096, 16, 16, 0, 0]]),
        # one chunk claims 1 TB of raw bytes
        "chunk raw": one_tensor([tb], [[0, 0, gib]], [[4096, 16, tb, 0, 0]]),
        # a 1 GiB chunk from 16 stored bytes: over the 65536:1 expansion cap
        "expansion": one_tensor([gib], [[0, 0, gib]], [[4096, 16, gib, 0, 0]]),
        # one 1 GiB chunk (16 KiB stored: exactly at the cap) referenced 1024 times: bytes are
        # referenced once only
        "double reference": one_tensor([tb], [[0, 0, gib]] * 1024, [[4096, 16384, gib, 0, 0]]),
        # the same through torch
        "torch": one_tensor([1 << 20, 1 << 20], [[0, 0, gib]] * 1024, [[4096, 16384, gib, 0, 0]], "torch"),
    }


@pytest.mark.parametrize("case", sorted(_terabyte_cases()))
def test_terabyte_claim_is_refused_before_allocating(tmp_path: Path, case: str) -> None:
    doc = _terabyte_cases()[case]
    path = tmp_path / "tb.gdsckpt"
    path.write_bytes(spec.build_file(doc, bytes(16384)))
    assert path.stat().st_size < 128 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError) as caught:
            gdsckpt.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"peak allocation {peak} bytes"
    frames = [frame.f_code.co_name for frame, _ in traceback.walk_tb(caught.value.__traceback__)]
    assert "parse_index" in frames, "refused by index validation, not by a failed allocation"
    assert "_restore_arrays" not in frames


# ---------------------------------------------------------------------------------------------
# file-level damage

def _load_bytes(tmp_path: Path, data: bytes) -> Any:
    path = tmp_path / "damaged.gdsckpt"
    path.write_bytes(data)
    return gdsckpt.load(path)


@pytest.mark.parametrize("damage", [
    "truncated", "appended", "header crc", "trailer crc", "index crc", "chunk crc", "tiny", "index length",
])
def test_damaged_file_is_corrupt(tmp_path: Path, damage: str) -> None:
    data = bytearray(GOLDEN_BYTES)
    if damage == "truncated":
        data = data[:-100]
    elif damage == "appended":
        data += b"\x00"
    elif damage == "header crc":
        data[30] ^= 1
    elif damage == "trailer crc":
        data[-10] ^= 1
    elif damage == "index crc":
        data[GOLDEN_OFFSET + 20] ^= 1
    elif damage == "chunk crc":
        data[4096 + 100] ^= 0x80
    elif damage == "tiny":
        data = data[:4000]
    elif damage == "index length":
        data[-64 + 24] += 1
        body = bytes(data[-64:-4])
        data[-4:] = spec.crc32c_pure(body).to_bytes(4, "little")
    with pytest.raises(CorruptCheckpointError):
        _load_bytes(tmp_path, bytes(data))


# ---------------------------------------------------------------------------------------------
# fuzzing

def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found.extend(_paths(value, prefix + (key,)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.extend(_paths(value, prefix + (i,)))
    return found


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


INTERESTING_INTS = [0, 1, -1, 2, 8, 4095, 4096, 4097, 8192, 1 << 30, (1 << 30) + 1, 1 << 32, 1 << 60,
                    1 << 63, 1 << 64, -(1 << 63)]
INTERESTING_STRINGS = ["", "torch", "numpy", "int64", "bfloat16", "none/1", "zstd/1", "tensor", "dict",
                       "list", "int", "float", "str", "bool", "none", "OrderedDict", "0", "-0",
                       "7ff8000000000000"]
SCALARS = (st.none() | st.booleans() | st.sampled_from(INTERESTING_INTS) | st.integers()
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6)
           | st.sampled_from(INTERESTING_STRINGS))
MEMBER_NAMES = st.sampled_from(["t", "v", "id", "items", "key", "name", "x"]) | st.text(max_size=4)
JSON_VALUES = st.recursive(SCALARS, lambda children: st.lists(children, max_size=4)
                           | st.dictionaries(MEMBER_NAMES, children, max_size=4), max_leaves=6)


@st.composite
def mutated_documents(draw: st.DrawFn) -> Any:
    doc = golden() if draw(st.booleans()) else tiny()
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        parent = _get(doc, path[:-1]) if path else None
        current = _get(doc, path)
        operation = draw(st.sampled_from(["replace", "replace", "tweak", "delete", "duplicate", "swap"]))
        if operation == "tweak" and isinstance(current, int) and not isinstance(current, bool) and path:
            parent[path[-1]] = current + draw(st.sampled_from([-4097, -4096, -8, -1, 1, 2, 8, 4096, 1 << 20]))
        elif operation == "delete" and path:
            del parent[path[-1]]
        elif operation == "duplicate" and isinstance(parent, list):
            parent.insert(path[-1], copy.deepcopy(current))
        elif operation == "swap" and isinstance(parent, list) and len(parent) > 1:
            j = draw(st.integers(0, len(parent) - 1))
            parent[path[-1]], parent[j] = parent[j], parent[path[-1]]
        elif path:
            parent[path[-1]] = draw(JSON_VALUES)
        else:
            doc = draw(JSON_VALUES)
    return doc


def _offset_for(doc: Any) -> int:
    return GOLDEN_OFFSET if isinstance(doc, dict) and doc.get("writer") != "test" else 8192


@FUZZ
@given(mutated_documents())
def test_fuzz_mutated_index(doc: Any) -> None:
    index_offset = _offset_for(doc)
    try:
        parse(doc, index_offset)
    except UnsupportedFormatError:
        assert isinstance(doc, dict) and doc.get("format") == "gdsckpt" and doc["version"][0] != 1
    except CheckpointError:
        pass
    else:
        assert spec.violations(doc, index_offset) == [], "the parser accepted an index the spec rejects"


@FUZZ
@given(st.data())
def test_fuzz_index_bytes(data: st.DataObject) -> None:
    raw = bytearray(GOLDEN_INDEX if data.draw(st.booleans()) else json.dumps(tiny()).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(raw)))
        operation = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        if operation == "flip" and position < len(raw):
            raw[position] = data.draw(st.integers(0, 255))
        elif operation == "insert":
            raw[position:position] = data.draw(st.binary(min_size=1, max_size=8))
        elif operation == "delete":
            del raw[position:position + data.draw(st.integers(1, 16))]
        else:
            del raw[position:]
    try:
        parse_index(bytes(raw), index_offset=GOLDEN_OFFSET)
    except CheckpointError:
        pass


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(raw: bytes) -> None:
    with pytest.raises(CheckpointError):
        parse_index(raw, index_offset=GOLDEN_OFFSET)


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(st.integers(0, len(GOLDEN_BYTES) - 1), st.integers(1, 255))
def test_fuzz_file_bytes(position: int, xor: int) -> None:
    """Any single damaged byte of a file is caught (by a checksum or a check) on load."""
    import tempfile

    data = bytearray(GOLDEN_BYTES)
    data[position] ^= xor
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.gdsckpt"
        path.write_bytes(bytes(data))
        try:
            gdsckpt.load(path)
        except CheckpointError:
            return
    # The only bytes no checksum covers: the header region after byte 64 and chunk padding.
    in_header_padding = 64 <= position < 4096
    in_chunk_padding = any(offset + stored <= position < spec.align_up(offset + stored)
                           for offset, stored, *_ in GOLDEN_DOC["chunks"])
    assert in_header_padding or in_chunk_padding, f"damage at byte {position} went unnoticed"
