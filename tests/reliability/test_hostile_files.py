"""Hostile files through the whole reader: ``gdsckpt.load``, ``open().get``, ``inspect`` and
``verify`` on files built to attack the header, trailer and index parsers and the decoders.

tests/format/test_parser.py feeds hostile *index documents* to ``parse_index``; here hostile
*files* go through every public entry point, with checksums repaired after each mutation so the
damage reaches the validators behind them:

- hypothesis mutates the header, trailer, index and chunk bytes of a real file, and generates
  indexes from scratch with extreme, negative, huge, overlapping and mistyped offsets and lengths,
  unknown dtypes, huge shapes, deep nesting and keys such as ``..``, ``/abs`` and NUL: only
  ``CheckpointError`` subclasses may escape (never IndexError, KeyError, OverflowError,
  MemoryError, RecursionError, UnicodeError, ...);
- files of a few KiB claiming a terabyte are refused before anything is allocated, measured in a
  fresh process (tracemalloc peak, RSS growth and virtual-memory peak);
- offset + length sums that would wrap in 64-bit arithmetic are rejected by validation;
- tensor keys never reach the filesystem through load, ``CheckpointManager`` or the DCP reader;
- libFuzzer (atheris), where installed, runs coverage-guided over the reader.

Run as ``python -m reliability.test_hostile_files CHILD`` (cwd ``tests/``), this module is the
child process of the memory measurement.
"""

from __future__ import annotations

import json
import os
import re
import resource
import struct
import sys
import threading
import time
import traceback
import tracemalloc
import uuid
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from format import spec  # tests/format/spec.py: docs/format.md implemented without gdsckpt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gdsckpt
from gdsckpt.errors import CheckpointError, CorruptCheckpointError
from gdsckpt.format import TRAILER_SIZE, align_up, checksum, unpack_trailer

from .harness import record_figure

CONFIG = gdsckpt.Config(chunk_bytes=4096, pack_below=512, codec_threads=1, io_threads=1, fsync=False)
FUZZ = settings(max_examples=250, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])

EXTREME_INTS = [-1, -4096, 0, 1, 7, 4095, 4096, 4097, 8192, 1 << 30, (1 << 30) + 1, 1 << 32, 1 << 40,
                1 << 60, (1 << 63) - 1, 1 << 63, (1 << 64) - 4096, 1 << 64, (1 << 64) + 4096, 10 ** 30,
                -(1 << 63)]
WRONG_TYPES: list[Any] = [None, True, False, 1.5, 4096.0, float("inf"), float("nan"), "4096", "", [], {},
                          [4096], {"offset": 4096}]
HOSTILE_NAMES = ["..", ".", "../../etc/passwd", "/abs", "/", "", "a\x00b", "\x00", "~", "~1", "~0~1", "a/b",
                 "C:\\Windows\\x", "..\\..\\x", "\u202eevil", "\udcff", "\U0001f600", "x" * 300, "nul",
                 "con", "0", "-0", "True", "None"]
WEIRD_DTYPES: list[Any] = ["float128", "", "Float32", "float32\x00", "int64 ", "object", "str", "complex256",
                           5, None, ["float32"], {"name": "int8"}]
WEIRD_KINDS: list[Any] = ["tensorflow", "", "TORCH", "numpy\x00", None, 1, ["torch"], {"kind": "torch"}]
HUGE_SHAPES: list[Any] = [[1 << 40], [-1], [1 << 32, 1 << 32], [1 << 31, 1 << 31, 4], [0, 1 << 59, 1 << 59],
                          [0] + [1 << 59] * 3, [1 << 60], [(1 << 60) - 1], [1] * 65, [1] * 64, [], [1.0], ["3"],
                          [True], [None], [1 << 64], [0, -1], 3, None, {"0": 1}, "16"]
WEIRD_DEVICES: list[Any] = ["cuda:x", "cuda:-1", "cuda:99999999999999999999", "", "tpu:0", "cpu\x00", "meta",
                            "cuda", 5, None, ["cpu"]]
WEIRD_EXTRAS: list[Any] = [{"parameter": {"requires_grad": True}}, {"parameter": {"requires_grad": "yes"}},
                           {"parameter": []}, {"parameter": None}, {"parameter": True}, {"scalar": True},
                           {"scalar": "no"}, {"scalar": [1]}, {"alias": None}, {"segments": None}]
WEIRD_CHAINS: list[Any] = [
    [{"name": "byteplanes/1", "width": w}, {"name": "none/1"}] for w in (2, 4, 8, 3, 0, -1, "2", None, 1 << 64,
                                                                       True, 1.5)
] + [[{"name": "zstd/1"}], [{"name": "lz4/1"}], [{"name": "deflate/1"}], [{"name": "brotli/3"}],
     [{"name": "nvcomp.ans/1"}], [{"name": "none/1"}, {"name": "none/1"}], [{"name": "byteplanes/1"}],
     [{"name": "zstd/1"}, {"name": "zstd/1"}], [], [{"name": "none/1", "x": {"y": [1]}}]]
SCALAR_KEYS: list[Any] = [{"t": "int", "v": "9" * 4300}, {"t": "int", "v": "-0"}, {"t": "int", "v": "1"},
                          {"t": "float", "v": "7ff8000000000001"}, {"t": "float", "v": "3ff0000000000000"},
                          {"t": "float", "v": "8000000000000000"}, {"t": "bool", "v": True}, {"t": "none"},
                          {"t": "str", "v": "\x00"}, {"t": "str", "v": "\udcff"}]
VALID_DTYPES = ["uint8", "int8", "bool", "int32", "int64", "float16", "bfloat16", "float32", "float64",
                "complex64", "float8_e4m3fn", "uint64"]  # complex32: torch warns on every allocation
ESCAPE = str.maketrans({"~": "~0", "/": "~1"})


def _exercise(path: Path) -> str:
    """Open, read every key lazily, load, verify and inspect ``path``; only ``CheckpointError``
    may escape. Returns how far the file got (for the figures)."""
    stage = "rejected at open"
    try:
        with gdsckpt.open(path, config=CONFIG) as ckpt:
            stage = "opened"
            for key in ckpt:
                info = ckpt.info(key)
                try:
                    value = ckpt.get(key)
                except CheckpointError:
                    stage = "opened, a tensor rejected"
                    continue
                assert tuple(value.shape) == tuple(info.shape), (key, value.shape, info.shape)
    except CheckpointError:
        pass
    try:
        gdsckpt.load(path, config=CONFIG)
        stage = "loaded"
    except CheckpointError:
        pass
    for operation in (gdsckpt.verify, gdsckpt.inspect):
        try:
            operation(path, config=CONFIG)
        except CheckpointError:
            pass
    return stage


def _serialize(doc: dict[str, Any]) -> bytes:
    """Compact JSON; ensure_ascii so lone surrogates travel as escapes, as a hostile writer may."""
    return json.dumps(doc, separators=(",", ":")).encode("ascii")


def _trailer(index_offset: int, index: bytes) -> bytes:
    """spec.pack_trailer with the hardware CRC (megabyte indexes are built by the thousand here)."""
    body = spec.TRAILER.pack(spec.TRAILER_MAGIC, 1, 0, 0, index_offset, len(index), spec.crc32c_fast(index), 0,
                             index_offset + len(index) + TRAILER_SIZE, bytes(12), 0)[:60]
    return body + struct.pack("<I", spec.crc32c_fast(body))


def _repair_trailer(data: bytearray, index_offset: int, index: bytes, fields: dict[int, int] | None = None,
                    fix_crc: bool = True) -> bytearray:
    """``data``'s chunk area, then ``index`` and a trailer pointing at it; ``fields`` (trailer offset ->
    u64) override values before the CRC is computed."""
    out = bytearray(data[:index_offset]) + index + _trailer(index_offset, index)
    for at, value in (fields or {}).items():
        width = 2 if at in (8, 10) else 8
        struct.pack_into("<H" if width == 2 else "<Q", out, len(out) - TRAILER_SIZE + at,
                         value % (1 << (8 * width)))
    if fix_crc:
        body = bytes(out[-TRAILER_SIZE:-4])
        out[-4:] = struct.pack("<I", checksum(body))
    return out


# ---------------------------------------------------------------------------------------------
# hypothesis: byte mutations of a real file, checksums repaired

def _base_state() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {
        "model": {"w": torch.from_numpy(rng.standard_normal(1500).astype(np.float32)),
                  "h": torch.from_numpy(rng.standard_normal(700).astype(np.float32)).to(torch.bfloat16),
                  "..": {"/abs": torch.arange(40, dtype=torch.int32)}},
        "np": rng.integers(-5, 5, 300).astype(np.int64),
        "small": [torch.ones(3), np.float64(-0.0), torch.tensor([float("nan")])],
        "step": 3,
    }


@pytest.fixture(scope="module")
def base_file(tmp_path_factory: Any) -> bytes:
    path = tmp_path_factory.mktemp("hostile-base") / "base.gdsckpt"
    gdsckpt.save(_base_state(), path, codec="zstd", config=CONFIG)
    return path.read_bytes()


TRAILER_FIELDS = {8: "major", 10: "minor", 16: "index_offset", 24: "index_length", 40: "file_length"}


@st.composite
def mutated_files(draw: st.DrawFn, base: bytes) -> bytes:
    size = len(base)
    trailer = unpack_trailer(base[-TRAILER_SIZE:], size)
    index_offset = trailer.index_offset
    doc = json.loads(base[index_offset:size - TRAILER_SIZE])
    data = bytearray(base)
    # chunk bytes: flip bytes and repair the chunk's CRC in the index, so the decoders see the damage
    for _ in range(draw(st.integers(0, 2))):
        number = draw(st.integers(0, len(doc["chunks"]) - 1))
        offset, stored = doc["chunks"][number][:2]
        at = offset + draw(st.integers(0, stored - 1))
        data[at] ^= draw(st.integers(1, 255))
        doc["chunks"][number][3] = checksum(bytes(data[offset:offset + stored]))
    index = bytearray(_serialize(doc))
    # index bytes: flips, insertions, deletions, truncation (the index CRC is then repaired)
    for _ in range(draw(st.integers(0, 3))):
        position = draw(st.integers(0, len(index)))
        operation = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "digit"]))
        if operation == "flip" and position < len(index):
            index[position] = draw(st.integers(0, 255))
        elif operation == "insert":
            index[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif operation == "delete":
            del index[position:position + draw(st.integers(1, 16))]
        elif operation == "digit":
            digits = [m.start() for m in re.finditer(rb"[0-9]+", bytes(index))]
            if digits:
                at = draw(st.sampled_from(digits))
                index[at:at] = draw(st.sampled_from([b"-", b"9" * 20, b"1" * 5000, b"0.", b"1e9", b"00"]))
        else:
            del index[position:]
    fields = {at: draw(st.sampled_from(EXTREME_INTS + [size, size - 64, index_offset]))
              for at in draw(st.sets(st.sampled_from(sorted(TRAILER_FIELDS)), max_size=2))}
    data = _repair_trailer(data, index_offset, bytes(index), fields, fix_crc=draw(st.booleans()) or not fields)
    # header bytes [0, 64): overwritten, CRC repaired unless the CRC itself was hit
    for _ in range(draw(st.integers(0, 2))):
        data[draw(st.integers(0, 63))] = draw(st.integers(0, 255))
        if draw(st.booleans()):
            data[60:64] = struct.pack("<I", checksum(bytes(data[:60])))
    return bytes(data)


def test_fuzz_file_mutations_raise_only_checkpoint_errors(base_file: bytes, tmp_path: Path) -> None:
    path = tmp_path / "mutated.gdsckpt"
    stages: Counter[str] = Counter()

    @FUZZ
    @given(mutated_files(base_file))
    def run(data: bytes) -> None:
        path.write_bytes(data)
        stages[_exercise(path)] += 1

    run()
    record_figure("hostile byte mutations",
                  f"{sum(stages.values())} hypothesis-mutated files (header, trailer, index and chunk bytes, "
                  f"checksums repaired) through open/get/load/verify/inspect: "
                  + ", ".join(f"{name} {count}" for name, count in sorted(stages.items()))
                  + "; 0 non-CheckpointError exceptions")
    assert stages["rejected at open"] < sum(stages.values()), "every mutation stopped at open"


# ---------------------------------------------------------------------------------------------
# hypothesis: indexes generated from scratch


@st.composite
def valid_documents(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    """A valid index and the chunk area it describes: 1-4 tensors with hostile names in 1-3 chunks."""
    rng = draw(st.randoms(use_true_random=False))
    names = draw(st.lists(st.sampled_from(HOSTILE_NAMES) | st.text(max_size=5), min_size=1, max_size=4,
                          unique_by=lambda n: n.translate(ESCAPE)))
    n_chunks = draw(st.integers(1, 3))
    raw_parts: list[list[tuple[int, int]]] = [[] for _ in range(n_chunks)]  # (tensor, nbytes)
    tensors = []
    for number, name in enumerate(names):
        dtype = draw(st.sampled_from(VALID_DTYPES))
        shape = draw(st.lists(st.integers(0, 6), max_size=3))
        kind = draw(st.sampled_from(["torch", "numpy", "numpy", "torch", "jax"]))
        record = {"key": name.translate(ESCAPE), "kind": kind, "dtype": dtype, "shape": shape,
                  "device": "cpu", "segments": []}
        nbytes = int(np.prod(shape)) * spec.DTYPES[dtype][0]
        if nbytes:
            raw_parts[draw(st.integers(0, n_chunks - 1))].append((number, nbytes))
        tensors.append(record)
    chains = [[{"name": "none/1"}], [{"name": "zstd/1"}], [{"name": "byteplanes/1", "width": 2}, {"name": "none/1"}]]
    chunks, area, offset = [], bytearray(), 4096
    for parts in raw_parts:
        if not parts:
            continue
        length = sum(n for _, n in parts)
        raw = rng.getrandbits(8 * length).to_bytes(length, "little")
        position = 0
        for owner, nbytes in parts:
            tensors[owner]["segments"].append([len(chunks), position, nbytes])
            position += nbytes
        chain = draw(st.integers(0, 1 if len(raw) % 2 else 2))
        stored = zstandard.ZstdCompressor().compress(raw) if chain == 1 else raw
        if chain == 2:
            stored = bytes(spec.byteplanes_forward(raw, 2))
        chunks.append([offset, len(stored), len(raw), spec.crc32c_fast(stored), chain])
        area += stored + bytes(align_up(len(stored)) - len(stored))
        offset += align_up(len(stored))
    items = [[{"t": "str", "v": name}, {"t": "tensor", "id": i}] for i, name in enumerate(names)]
    doc = {"format": "gdsckpt", "version": [1, 0], "writer": "hostile", "checksum": "crc32c",
           "alignment": 4096, "chains": chains, "chunks": chunks, "tensors": tensors,
           "tree": {"t": "dict", "items": items}}
    return doc, bytes(area)


def _pick(draw: st.DrawFn, items: list[Any]) -> Any:
    return items[draw(st.integers(0, len(items) - 1))]


def _edit_chunk_field(doc: dict[str, Any], draw: st.DrawFn) -> None:
    if doc["chunks"]:
        chunk = _pick(draw, doc["chunks"])
        chunk[draw(st.integers(0, 4))] = _pick(draw, EXTREME_INTS + WRONG_TYPES)


def _edit_chunk_overlap(doc: dict[str, Any], draw: st.DrawFn) -> None:
    chunks = doc["chunks"]
    if chunks:
        end = 4096 + sum(align_up(c[1]) for c in chunks)
        number = draw(st.integers(0, len(chunks) - 1))
        chunks[number][0] = _pick(draw, [0, 2048, end, end - 4096, chunks[number - 1][0], 1 << 40])
        if draw(st.booleans()):
            chunks[number][1] = end - chunks[number][0] + draw(st.sampled_from([1, 4096, 1 << 64]))


def _edit_segment(doc: dict[str, Any], draw: st.DrawFn) -> None:
    segments = [s for t in doc["tensors"] for s in t.get("segments") or []]
    if segments:
        _pick(draw, segments)[draw(st.integers(0, 2))] = _pick(draw, EXTREME_INTS + WRONG_TYPES)


def _edit_record(doc: dict[str, Any], draw: st.DrawFn) -> None:
    record = _pick(draw, doc["tensors"])
    field = draw(st.sampled_from(["shape", "dtype", "kind", "device", "extra", "key", "drop"]))
    if field == "shape":
        record["shape"] = _pick(draw, HUGE_SHAPES)
    elif field == "dtype":
        record["dtype"] = _pick(draw, WEIRD_DTYPES + VALID_DTYPES)
    elif field == "kind":
        record["kind"] = _pick(draw, WEIRD_KINDS)
    elif field == "device":
        record["device"] = _pick(draw, WEIRD_DEVICES)
    elif field == "extra":
        record.update(_pick(draw, WEIRD_EXTRAS))
    elif field == "key":
        record["key"] = _pick(draw, HOSTILE_NAMES + [1, None])
    else:
        del record[draw(st.sampled_from(sorted(record)))]


def _edit_chain(doc: dict[str, Any], draw: st.DrawFn) -> None:
    doc["chains"][draw(st.integers(0, len(doc["chains"]) - 1))] = _pick(draw, WEIRD_CHAINS)


def _edit_alias(doc: dict[str, Any], draw: st.DrawFn) -> None:
    target = _pick(draw, doc["tensors"])
    alias = dict(target, key="alias", alias=_pick(draw, [0, len(doc["tensors"]) - 1, -1, 1 << 64, "0", None]))
    alias.pop("segments", None)
    doc["tensors"].append(alias)
    doc["tree"]["items"].append([{"t": "str", "v": "alias"}, {"t": "tensor", "id": len(doc["tensors"]) - 1}])


def _edit_tree(doc: dict[str, Any], draw: st.DrawFn) -> None:
    items = doc["tree"]["items"]
    choice = draw(st.sampled_from(["key", "duplicate", "meta", "many", "unref", "nest"]))
    if not items and choice in ("key", "duplicate", "unref"):
        return  # an earlier edit removed the only entry
    if choice == "key":
        _pick(draw, items)[0] = _pick(draw, SCALAR_KEYS)
    elif choice == "duplicate":
        items.append(list(_pick(draw, items)))
    elif choice == "meta":
        doc["tree"].update(cls="OrderedDict", meta=_pick(draw, [{"t": "tensor", "id": 0}, {"t": "none"}, [],
                                                                {"t": "dict", "items": [[{"t": "none"},
                                                                                         {"t": "int", "v": "1"}]]}]))
    elif choice == "many":
        items.extend([[{"t": "int", "v": str(i)}, {"t": "none"}] for i in range(5000)])
    elif choice == "unref":
        items.pop()
    else:  # nest the whole tree 50 or 300 levels deep, keeping key paths consistent
        depth, kind = draw(st.sampled_from([50, 300])), draw(st.sampled_from(["list", "tuple", "dict"]))
        node = doc["tree"]
        for _ in range(depth):
            node = ({"t": "dict", "items": [[{"t": "str", "v": "k"}, node]]} if kind == "dict"
                    else {"t": kind, "items": [node]})
        doc["tree"] = node
        for record in doc["tensors"]:
            record["key"] = ("k/" if kind == "dict" else "0/") * depth + str(record.get("key"))


def _edit_top(doc: dict[str, Any], draw: st.DrawFn) -> None:
    key, value = draw(st.sampled_from([
        ("version", [1, 1 << 70]), ("version", [1, -1]), ("version", [1.0, 0]), ("version", [1, 0, 0]),
        ("writer", 5), ("user", [[[[[]]]]]), ("user", {"x": "\udcff"}), ("alignment", 4096.0),
        ("alignment", 8192), ("checksum", "CRC32C"), ("format", "GDSCKPT"), ("chunks", {}), ("tensors", None),
        ("tree", None), ("chains", [[{"name": "none/1"}]] * 20000)]))
    doc[key] = value


EDITS: list[Callable[[dict[str, Any], st.DrawFn], None]] = [
    _edit_chunk_field, _edit_chunk_overlap, _edit_segment, _edit_record, _edit_record, _edit_chain,
    _edit_alias, _edit_tree, _edit_top]


@st.composite
def hostile_files(draw: st.DrawFn) -> tuple[dict[str, Any], bytes, bool]:
    doc, area = draw(valid_documents())
    edits = draw(st.lists(st.sampled_from(EDITS), max_size=3))
    # Top-level replacements (a list of tensors that is None, ...) go last: the other edits change
    # parts of a well-formed document, and one replaced before them would leave nothing to edit.
    for edit in sorted(edits, key=lambda edit: edit is _edit_top):
        edit(doc, draw)
    deep = draw(st.sampled_from([0, 0, 0, 0, 0, 600, 2000, 20000]))
    if deep and isinstance(doc.get("tree"), dict):  # the tree last, so its closing brace ends the text
        doc["tree"] = doc.pop("tree")
    index = _serialize(doc)
    if deep:  # JSON nested deeper than the tree may go (512) or than the parser's stack
        wrapper = b'{"t":"list","items":['
        index = index.replace(b'"tree":{', b'"tree":' + wrapper * deep + b'{', 1)[:-1] + b"]}" * deep + b"}"
    head = spec.pack_header() + area
    return doc, head + index + _trailer(len(head), index), bool(deep)


# A generated case holds up to 20,000 chains: Hypothesis warns that printing it is expensive.
@pytest.mark.filterwarnings("ignore:Generating overly large repr")
def test_fuzz_generated_indexes_raise_only_checkpoint_errors(tmp_path: Path) -> None:
    path = tmp_path / "generated.gdsckpt"
    stages: Counter[str] = Counter()

    @FUZZ
    @given(hostile_files())
    def run(case: tuple[dict[str, Any], bytes, bool]) -> None:
        doc, data, deep = case
        path.write_bytes(data)
        stage = _exercise(path)
        stages[stage] += 1
        if stage != "rejected at open":
            assert not deep, "JSON nested past the tree depth limit was accepted"
            index_offset = unpack_trailer(data[-TRAILER_SIZE:], len(data)).index_offset
            assert spec.violations(doc, index_offset) == [], "the reader accepted an index the spec rejects"

    run()
    record_figure("hostile generated indexes",
                  f"{sum(stages.values())} generated files (extreme/negative/huge/overlapping offsets and "
                  f"lengths, wrong types, huge shapes, unknown dtypes, chains and kinds, hostile keys, "
                  f"nesting to 20000) through open/get/load/verify/inspect: "
                  + ", ".join(f"{name} {count}" for name, count in sorted(stages.items()))
                  + "; 0 non-CheckpointError exceptions")
    assert stages["loaded"] > 0 and stages["rejected at open"] > 0, stages


# ---------------------------------------------------------------------------------------------
# arithmetic that would wrap in 64 bits, and regions the index may not point into


def _tiny(**changes: Any) -> dict[str, Any]:
    """One 16-byte chunk at 4096 holding uint8 tensor "x" (index at 8192)."""
    doc = {"format": "gdsckpt", "version": [1, 0], "writer": "", "checksum": "crc32c",
           "chains": [[{"name": "none/1"}]], "chunks": [[4096, 16, 16, spec.crc32c_fast(bytes(16)), 0]],
           "tensors": [{"key": "x", "kind": "numpy", "dtype": "uint8", "shape": [16], "segments": [[0, 0, 16]]}],
           "tree": {"t": "dict", "items": [[{"t": "str", "v": "x"}, {"t": "tensor", "id": 0}]]}}
    for path, value in changes.items():
        target: Any = doc
        *parents, last = path.split(".")
        for part in parents:
            target = target[int(part) if part.isdigit() else part]
        target[int(last) if last.isdigit() else last] = value
    return doc


WRAP = 1 << 64
ARITHMETIC_CASES: dict[str, Any] = {
    "chunk offset + stored wraps to the index": _tiny(**{"chunks.0.0": WRAP - 4096, "chunks.0.1": 8192}),
    "chunk stored wraps past 2^64": _tiny(**{"chunks.0.1": WRAP - 4096 + 16}),
    "chunk offset beyond the file": _tiny(**{"chunks.0.0": 1 << 40}),
    "chunk offset negative": _tiny(**{"chunks.0.0": -4096}),
    "chunk stored negative": _tiny(**{"chunks.0.1": -16}),
    "chunk inside the header": _tiny(**{"chunks.0.0": 0}),
    "chunk at the index": _tiny(**{"chunks.0.0": 8192}),
    "chunk runs into the index": _tiny(**{"chunks.0.1": 4097, "chunks.0.2": 16}),
    "segment offset + length wraps": _tiny(**{"tensors.0.segments": [[0, WRAP - 8, 16]]}),
    "segment offset negative": _tiny(**{"tensors.0.segments": [[0, -8, 16]]}),
    "segment length negative": _tiny(**{"tensors.0.segments": [[0, 8, -8]]}),
    "shape product wraps to 0 (2^32 x 2^32)": _tiny(**{"tensors.0.shape": [1 << 32, 1 << 32]}),
    "shape times itemsize wraps (2^31 x 2^31 x 4, int32)": _tiny(**{"tensors.0.shape": [1 << 31, 1 << 31, 4],
                                                                    "tensors.0.dtype": "int32"}),
    "empty shape whose strides overflow [0, 2^59, 2^59]": _tiny(**{"tensors.0.shape": [0, 1 << 59, 1 << 59],
                                                                   "tensors.0.segments": [], "chunks": []}),
    "negative dimension": _tiny(**{"tensors.0.shape": [-16]}),
    "dimension 2^64 + 16": _tiny(**{"tensors.0.shape": [WRAP + 16]}),
}


@pytest.mark.parametrize("case", sorted(ARITHMETIC_CASES))
def test_wrapping_offsets_and_sizes_are_refused_by_validation(case: str, tmp_path: Path) -> None:
    path = tmp_path / "wrap.gdsckpt"
    path.write_bytes(spec.build_file(ARITHMETIC_CASES[case], bytes(16)))
    for operation in (gdsckpt.load, gdsckpt.inspect, gdsckpt.verify, gdsckpt.open):
        with pytest.raises(CorruptCheckpointError, match="invalid index") as caught:
            operation(path, config=CONFIG)
        frames = [frame.f_code.co_name for frame, _ in traceback.walk_tb(caught.value.__traceback__)]
        assert "parse_index" in frames and "_restore_arrays" not in frames, frames


@pytest.mark.parametrize("case", ["index_offset wraps", "offset and length wrap", "file_length short",
                                  "index_length over 1 GiB", "index inside the header"])
def test_trailer_arithmetic_is_refused(case: str, tmp_path: Path) -> None:
    """Trailer values that satisfy ``index_offset + index_length + 64 == size`` only modulo 2^64."""
    data = bytearray(spec.build_file(_tiny(), bytes(16)))
    size, index_offset = len(data), 8192
    index = bytes(data[index_offset:size - TRAILER_SIZE])
    fields = {
        "index_offset wraps": {16: WRAP - 4096, 24: size - TRAILER_SIZE + 4096},
        "offset and length wrap": {16: 1 << 63, 24: (1 << 63) + size - TRAILER_SIZE},
        "file_length short": {40: size - 1},
        "index_length over 1 GiB": {24: (1 << 30) + 1, 16: 4096},
        "index inside the header": {16: 0, 24: size - TRAILER_SIZE},
    }[case]
    path = tmp_path / "trailer.gdsckpt"
    path.write_bytes(_repair_trailer(data, index_offset, index, fields))
    for operation in (gdsckpt.load, gdsckpt.inspect, gdsckpt.verify, gdsckpt.open):
        with pytest.raises(CorruptCheckpointError, match="index|file is|trailer") as caught:
            operation(path, config=CONFIG)
        frames = [frame.f_code.co_name for frame, _ in traceback.walk_tb(caught.value.__traceback__)]
        assert "unpack_trailer" in frames, frames


# ---------------------------------------------------------------------------------------------
# terabyte claims: refused before allocating, measured in a fresh process


def _terabyte_files() -> dict[str, bytes]:
    tb, gib = 1 << 40, 1 << 30
    one_gib_chunk = [[4096, 16384, gib, spec.crc32c_fast(bytes(16384)), 0]]
    many = _tiny(**{"chunks": one_gib_chunk, "tensors.0.shape": [gib], "tensors.0.segments": [[0, 0, gib]]})
    many["tensors"] += [dict(many["tensors"][0], key=f"y{i}") for i in range(1023)]
    many["tree"]["items"] += [[{"t": "str", "v": f"y{i}"}, {"t": "tensor", "id": i + 1}] for i in range(1023)]
    docs = {
        "shape [2^40] backed by 16 bytes": (_tiny(**{"tensors.0.shape": [tb]}), 16),
        "torch shape [2^20, 2^20]": (_tiny(**{"tensors.0.shape": [1 << 20, 1 << 20], "tensors.0.kind": "torch"}),
                                     16),
        "chunk raw 2^40": (_tiny(**{"chunks.0.2": tb, "tensors.0.shape": [tb],
                                    "tensors.0.segments": [[0, 0, tb]]}), 16),
        "1 GiB from 16 stored bytes": (_tiny(**{"chunks.0.2": gib, "tensors.0.shape": [gib],
                                                "tensors.0.segments": [[0, 0, gib]]}), 16),
        "one 1 GiB chunk referenced 1024 times": (_tiny(**{"chunks": one_gib_chunk, "tensors.0.shape": [tb],
                                                           "tensors.0.segments": [[0, 0, gib]] * 1024}), 16384),
        "1024 tensors of 1 GiB on one chunk": (many, 16384),
        "empty tensor [0, 2^59, 2^59]": (_tiny(**{"tensors.0.shape": [0, 1 << 59, 1 << 59],
                                                  "tensors.0.segments": [], "chunks": [], "tensors.0.kind": "torch"}),
                                         0),
    }
    files = {name: spec.build_file(doc, bytes(area)) for name, (doc, area) in docs.items()}
    small = spec.build_file(_tiny(), bytes(16))
    files["trailer: index_length 2^40"] = bytes(_repair_trailer(bytearray(small), 8192, small[8192:-64],
                                                                {24: tb}))
    return files


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vm_peak() -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmPeak:"))


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RssSampler:
    """Resident-set growth over a phase: the peak a thread sampling /proc/self/statm every
    millisecond sees, or the kernel's high-water mark (ru_maxrss) where the phase raised it (then it
    is exact; otherwise the phase's true peak lies below the earlier high-water mark and the
    sampled peak can miss a spike shorter than the sampling period)."""

    def __init__(self) -> None:
        self.baseline = self.sampled = _rss()
        self.maxrss_before = self.maxrss_after = _maxrss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sampled = max(self.sampled, _rss())
            time.sleep(0.001)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sampled = max(self.sampled, _rss())
        self.maxrss_after = _maxrss()

    @property
    def growth(self) -> int:
        raised = self.maxrss_after > self.maxrss_before
        return (max(self.sampled, self.maxrss_after) if raised else self.sampled) - self.baseline


def _terabyte_child(directory: str) -> None:
    """Child process: every entry point on every terabyte file; prints one JSON line of figures."""
    from gdsckpt.manager import CheckpointManager, SkippedCheckpointWarning

    root = Path(directory)
    files = _terabyte_files()
    # warm up imports and thread pools on a good file, so the measurement sees only the claims
    good = root / "good.gdsckpt"
    good.write_bytes(spec.build_file(_tiny(), bytes(16)))
    gdsckpt.load(good, config=CONFIG)
    gdsckpt.load_into({"x": torch.zeros(16, dtype=torch.uint8)}, good, config=CONFIG)
    results: dict[str, Any] = {"files": {}, "sizes": {}}
    vm_before = _vm_peak()
    tracemalloc.start()
    path, run = root / "tb.gdsckpt", root / "run"
    run.mkdir()
    operations: list[Callable[[], Any]] = [
        lambda: gdsckpt.load(path, config=CONFIG),
        lambda: gdsckpt.open(path, config=CONFIG).get("x"),
        lambda: gdsckpt.inspect(path, config=CONFIG),
        lambda: gdsckpt.verify(path, config=CONFIG),
        lambda: gdsckpt.load_into({"x": torch.zeros(16, dtype=torch.uint8)}, path, config=CONFIG)]
    sampler = RssSampler()
    sampler.start()
    for name, data in files.items():
        path.write_bytes(data)
        results["sizes"][name] = len(data)
        raised = []
        for operation in operations:
            try:
                operation()
                raised.append("none")
            except CheckpointError as err:
                raised.append(type(err).__name__)
        (run / "step-0000000001.gdsckpt").write_bytes(data)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = CheckpointManager(run, config=CONFIG).restore_latest()
        skipped = [w for w in caught if issubclass(w.category, SkippedCheckpointWarning)]
        raised.append("skipped" if restored is None and skipped else f"restored {restored!r:.40}")
        results["files"][name] = raised
    sampler.stop()
    _, results["tracemalloc_peak"] = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    results["rss_growth"] = sampler.growth
    results["vm_peak_growth"] = _vm_peak() - vm_before
    print(json.dumps(results))


def test_terabyte_claims_are_refused_before_allocating(tmp_path: Path, h: Any) -> None:
    child = h.run_python("-m", "reliability.test_hostile_files", "terabyte", str(tmp_path),
                         cwd=h.REPO_ROOT / "tests", timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    for name, outcomes in results["files"].items():
        assert outcomes[:4] == ["CorruptCheckpointError"] * 4, (name, outcomes)
        assert outcomes[4] in ("CorruptCheckpointError", "StateMismatchError"), (name, outcomes)
        assert outcomes[5] == "skipped", (name, outcomes)
    mib = 1 << 20
    record_figure("terabyte claims",
                  f"{len(results['files'])} files of {min(results['sizes'].values())}-"
                  f"{max(results['sizes'].values())} bytes claiming up to 1 TiB, each through load, open().get, "
                  f"inspect, verify, load_into and CheckpointManager.restore_latest (skipped): all refused by "
                  f"validation; peak Python allocation {results['tracemalloc_peak'] / mib:.2f} MiB, RSS growth "
                  f"{results['rss_growth'] / mib:.1f} MiB, virtual-memory high-water mark raised by "
                  f"{results['vm_peak_growth'] / mib:.0f} MiB (fresh process)")
    assert results["tracemalloc_peak"] < 16 * mib
    assert results["rss_growth"] < 50 * mib
    assert results["vm_peak_growth"] < 2048 * mib  # a terabyte mapping would show here even untouched


# ---------------------------------------------------------------------------------------------
# decoders are told the exact output size and produce no more


def _bomb(codec: str, size: int) -> bytes:
    """A chunk whose stored bytes are a valid ``codec`` stream of ``size`` zero bytes, recorded in
    the index as ``raw == stored`` (so within every index limit): the decoder alone must refuse to
    produce more than ``raw``."""
    import zlib

    import lz4.block
    import zstandard

    zeros = bytes(size)
    if codec == "zstd/1":
        frame = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(zeros)
    elif codec == "lz4/1":
        frame = lz4.block.compress(zeros, store_size=False)
    else:
        compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
        frame = compressor.compress(zeros) + compressor.flush()
    doc = _tiny(**{"chains": [[{"name": codec}]],
                   "chunks": [[4096, len(frame), len(frame), spec.crc32c_fast(frame), 0]],
                   "tensors.0.shape": [len(frame)], "tensors.0.segments": [[0, 0, len(frame)]]})
    return spec.build_file(doc, frame)


@pytest.mark.parametrize("codec", [
    "zstd/1",  # refused from the frame header before decoding (codecs/cpu.py)
    "lz4/1", "deflate/1"])
def test_decoder_bomb_is_refused_without_allocating_its_size(codec: str, tmp_path: Path) -> None:
    path = tmp_path / "bomb.gdsckpt"
    path.write_bytes(_bomb(codec, 256 << 20))
    assert path.stat().st_size < 2 << 20
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="does not decode") as caught:
            gdsckpt.load(path, config=CONFIG)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.chunk == 0 and caught.value.key == "x"
    print(f"\n[reliability] decoder bomb {codec}: {path.stat().st_size}-byte file, 256 MiB stream, "
          f"peak Python allocation {peak / (1 << 20):.1f} MiB")
    assert peak < 64 << 20, f"decoding allocated {peak} bytes for a chunk of {path.stat().st_size} bytes"


# ---------------------------------------------------------------------------------------------
# array kinds this machine cannot build


def test_cupy_record_with_a_malformed_device_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "cupy.gdsckpt"
    path.write_bytes(spec.build_file(_tiny(**{"tensors.0.kind": "cupy", "tensors.0.device": "cuda:x"}), bytes(16)))
    with pytest.raises(CheckpointError):
        gdsckpt.load(path, config=CONFIG)


@pytest.mark.parametrize("keys", [({"t": "bool", "v": True}, {"t": "int", "v": "1"}),
                                  ({"t": "float", "v": "0000000000000000"}, {"t": "float", "v": "8000000000000000"})],
                         ids=["True-and-1", "0.0-and-minus-0.0"])
def test_dict_keys_equal_in_python_are_a_repeated_key(keys: Any, tmp_path: Path) -> None:
    doc = _tiny(**{"tensors.0.shape": [8], "tensors.0.segments": [[0, 0, 8]],
                   "tensors.0.key": "True" if keys[0]["t"] == "bool" else "0.0"})
    doc["tensors"].append(dict(doc["tensors"][0], key="1" if keys[0]["t"] == "bool" else "-0.0",
                               segments=[[0, 8, 8]]))
    doc["tree"]["items"] = [[keys[0], {"t": "tensor", "id": 0}], [keys[1], {"t": "tensor", "id": 1}]]
    path = tmp_path / "keys.gdsckpt"
    path.write_bytes(spec.build_file(doc, bytes(16)))
    for read in (gdsckpt.inspect, gdsckpt.load):  # both refuse it: a dict cannot hold the two keys
        with pytest.raises(CorruptCheckpointError, match="repeats a key"):
            read(path, config=CONFIG)


def test_jax_record_without_jax_is_a_checkpoint_error(tmp_path: Path) -> None:
    """A file saved from JAX arrays, loaded where JAX is not installed: a CheckpointError naming the
    package (it was ModuleNotFoundError, raised after every chunk had been read)."""
    path = tmp_path / "jax.gdsckpt"
    path.write_bytes(spec.build_file(_tiny(**{"tensors.0.kind": "jax"}), bytes(16)))
    try:
        import jax  # noqa: F401
    except ImportError:
        with pytest.raises(CheckpointError, match="needs the jax package"):
            gdsckpt.load(path, config=CONFIG)
        with gdsckpt.open(path, config=CONFIG) as ckpt, pytest.raises(CheckpointError, match="jax"):
            ckpt.get("x")
    else:  # pragma: no cover - JAX is not a test dependency
        assert bytes(np.asarray(gdsckpt.load(path, config=CONFIG)["x"])) == bytes(16)


# ---------------------------------------------------------------------------------------------
# keys never reach the filesystem

_AUDIT: dict[str, Any] = {"marker": None, "events": []}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    marker = _AUDIT["marker"]
    if marker is None or not (event == "open" or event.startswith(("os.", "shutil.", "pathlib."))):
        return
    for arg in args:
        text = os.fsdecode(arg) if isinstance(arg, (str, bytes, os.PathLike)) else ""
        if marker in text:
            _AUDIT["events"].append((event, text))


def _recording(marker: str | None) -> None:
    if not _AUDIT.get("installed"):
        sys.addaudithook(_audit)
        _AUDIT["installed"] = True
    _AUDIT["marker"] = marker


def _snapshot(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _insert(state: dict[Any, Any], parts: list[str], value: Any) -> None:
    for part in parts[:-1]:
        state = state.setdefault(part, {})
    state[parts[-1]] = value


def test_keys_never_reach_the_filesystem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from gdsckpt.dcp import GdsStorageReader, GdsStorageWriter
    from gdsckpt.manager import CheckpointManager

    probe = f"hostile-probe-{uuid.uuid4().hex[:8]}"
    outside = Path(f"/{probe}-root")
    g = torch.Generator().manual_seed(5)
    state: dict[Any, Any] = {}
    nested = [f"../../{probe}-rel".split("/"), ["", f"{probe}-root"],
              str(tmp_path / f"{probe}-inside").split("/"), [".", f"{probe}-dot"], ["~", f"{probe}-home"]]
    keyed = ["/".join(part.translate(ESCAPE) for part in parts) for parts in nested]  # ../../x, /x, ...
    for parts in nested:
        _insert(state, parts, torch.randn(7, generator=g))
    state[f"../../{probe}-escaped"] = torch.randn(5, generator=g)        # stored as ..~1..~1...
    state[f"a\x00{probe}-nul"] = torch.randn(3, generator=g)
    state[f"..\\..\\{probe}-win"] = np.arange(4.0)
    state["value"] = f"../../{probe}-value"
    path = tmp_path / "ckpts" / "hostile.gdsckpt"
    path.parent.mkdir()
    gdsckpt.save(state, path, config=CONFIG)
    with gdsckpt.open(path, config=CONFIG) as ckpt:
        assert set(keyed) <= set(ckpt.keys()), ckpt.keys()
    manager_dir = tmp_path / "run"
    CheckpointManager(manager_dir, config=CONFIG).save(1, state)
    dcp_dir = tmp_path / "dcp"
    dcp_state = {f"../../{probe}-dcp": torch.randn(6, generator=g), f"/{probe}-dcp-root": torch.arange(3.0),
                 "nested": {"..": torch.ones(2)}}
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save(dcp_state, storage_writer=GdsStorageWriter(dcp_dir, codec="zstd", fsync=False))
    cwd = tmp_path / "a" / "b" / "c"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)

    # the audit hook sees a file opened by a name holding the marker
    _recording(probe)
    try:
        (tmp_path / f"{probe}-guard").write_text("x")
    finally:
        _recording(None)
    assert _AUDIT["events"], "the audit hook must see opens"
    (tmp_path / f"{probe}-guard").unlink()
    _AUDIT["events"].clear()

    before = _snapshot(tmp_path)
    operations = 0
    _recording(probe)
    try:
        h.assert_same(state, gdsckpt.load(path, config=CONFIG))
        for key in keyed:
            assert gdsckpt.load(path, keys=[key], config=CONFIG)
        with gdsckpt.open(path, config=CONFIG) as ckpt:
            for key in ckpt:
                ckpt.info(key)
                ckpt.get(key)
                operations += 1
        gdsckpt.inspect(path, config=CONFIG)
        gdsckpt.verify(path, config=CONFIG)
        target = gdsckpt.load(path, config=CONFIG)
        del target[f"..\\..\\{probe}-win"]  # a NumPy array: load_into fills torch tensors
        gdsckpt.load_into(target, path, strict=False, config=CONFIG)
        manager = CheckpointManager(manager_dir, config=CONFIG)
        step, restored = manager.restore_latest()
        assert step == 1 and manager.steps() == [1]
        h.assert_same(state, restored)
        target_dcp = {k: torch.zeros_like(v) for k, v in dcp_state.items() if k != "nested"}
        target_dcp["nested"] = {"..": torch.zeros(2)}
        with pytest.warns(UserWarning, match="torch.distributed is disabled"):
            dcp.load(target_dcp, storage_reader=GdsStorageReader(dcp_dir))
        h.assert_same(dcp_state, target_dcp)
        operations += 9 + len(keyed)
    finally:
        _recording(None)
    for command in ("inspect", "verify"):
        result = h.run_python("-m", "gdsckpt", command, str(path), cwd=cwd)
        assert result.returncode == 0, result.stderr
        operations += 1
    after = _snapshot(tmp_path)
    assert after == before, sorted(set(after) ^ set(before))
    assert not _AUDIT["events"], _AUDIT["events"][:5]
    assert not os.path.lexists(outside) and not os.path.lexists(Path.home() / f"{probe}-home")
    record_figure("keys and the filesystem",
                  f"{len(keyed) + 3} hostile key paths (../../x, /abs, an absolute path inside the test tree, "
                  f"./x, ~/x, escaped ../, NUL, ..\\) through {operations} reads (load, load(keys=), "
                  f"open().get, inspect, verify, load_into, CheckpointManager.restore_latest, DCP load, CLI "
                  f"inspect/verify): 0 files created, 0 opens or other filesystem calls naming a key")


# ---------------------------------------------------------------------------------------------
# atheris (libFuzzer), when it is installed


ATHERIS_CHILD = r'''
import os, struct, sys
import atheris
with atheris.instrument_imports(include=["gdsckpt"]):
    import gdsckpt
    from gdsckpt.format import checksum
CONFIG = gdsckpt.Config(chunk_bytes=4096, codec_threads=1, io_threads=1, fsync=False)
PATH = os.path.join(sys.argv[1], "input.gdsckpt")

def repair(data):
    """Fix header, index and trailer checksums where the trailer still locates an index."""
    data = bytearray(data)
    if len(data) >= 4160:
        data[60:64] = struct.pack("<I", checksum(bytes(data[:60])))
        offset, length = struct.unpack_from("<QQ", data, len(data) - 48)
        if 4096 <= offset and offset + length + 64 == len(data):
            struct.pack_into("<I", data, len(data) - 32, checksum(bytes(data[offset:offset + length])))
        struct.pack_into("<Q", data, len(data) - 24, len(data))
        data[-4:] = struct.pack("<I", checksum(bytes(data[-64:-4])))
    return bytes(data)

def one_input(data):
    body = repair(data[1:]) if data[:1] == b"R" else data[1:]
    with open(PATH, "wb") as handle:
        handle.write(body)
    for operation in (gdsckpt.load, gdsckpt.verify, gdsckpt.inspect):
        try:
            operation(PATH, config=CONFIG)
        except gdsckpt.CheckpointError:
            pass

atheris.Setup([sys.argv[0], "-runs=" + sys.argv[3], "-seed=1", "-max_len=65536", "-timeout=20",
               "-rss_limit_mb=4096", sys.argv[2]], one_input)
atheris.Fuzz()
'''


def test_atheris_fuzzes_the_reader(base_file: bytes, tmp_path: Path, h: Any) -> None:
    import importlib.util

    if importlib.util.find_spec("atheris") is None:
        pytest.skip("atheris is not installed (optional: pip install atheris); the hypothesis tests above "
                    "cover the same entry points")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "repair").write_bytes(b"R" + base_file)
    (corpus / "raw").write_bytes(b"-" + base_file)
    runs = 1000
    child = h.run_python("-c", ATHERIS_CHILD, str(tmp_path), str(corpus), str(runs), timeout=300)
    output = child.stdout + child.stderr
    assert child.returncode == 0, output[-6000:]
    done = re.findall(r"#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+)", output)
    assert done and int(done[-1][0]) >= runs, output[-3000:]
    record_figure("atheris", f"libFuzzer (atheris) ran {done[-1][0]} inputs derived from a real file (half with "
                             f"checksums repaired) through load/verify/inspect: coverage {done[-1][1]} edges, "
                             f"{done[-1][2]} features, 0 crashes (non-CheckpointError exceptions)")


if __name__ == "__main__":
    if sys.argv[1] == "terabyte":
        _terabyte_child(sys.argv[2])
