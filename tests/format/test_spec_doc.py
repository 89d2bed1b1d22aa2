"""docs/format.md says what the code does: its tables, constants and worked example are checked
against the library here, so an edit to either side that breaks the other fails the suite."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from . import spec

DOC = (Path(__file__).resolve().parents[2] / "docs" / "format.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    start = DOC.index(title)
    following = DOC.find("\n## ", start + 1)
    return DOC[start:following if following != -1 else len(DOC)]


def test_struct_formats_match_layout() -> None:
    from gdsckpt.format import layout

    assert layout._HEADER.format == "<8sHHIII36sI" and '`"<8sHHIII36sI"`' in DOC
    assert layout._TRAILER.format == "<8sHHIQQIIQ12sI" and '`"<8sHHIQQIIQ12sI"`' in DOC
    assert spec.HEADER.format == layout._HEADER.format and spec.TRAILER.format == layout._TRAILER.format
    assert layout.MAGIC == b"\x93GDSCKPT" and layout.TRAILER_MAGIC == b"GDSCKIDX"
    assert (layout.FORMAT_MAJOR, layout.FORMAT_MINOR) == (1, 0)
    assert layout.ALIGNMENT == layout.HEADER_REGION == 4096


def test_dtype_table_matches_library() -> None:
    from gdsckpt.format import DTYPES

    rows = re.findall(r"^\| `([a-z0-9_]+)` +\| (\d+) +\| (\d+) +\|", _section("## 8. Dtypes"), re.MULTILINE)
    assert {name: (int(size), int(width)) for name, size, width in rows} == {
        name: (s.itemsize, s.plane_width) for name, s in DTYPES.items()}
    assert [name for name, _, _ in rows] == list(DTYPES)


def test_codec_names_match_registry() -> None:
    from gdsckpt.codecs import base

    section = _section("## 9. Codecs and transforms")
    portable = set(re.findall(r"^\| `([a-z0-9]+/1)` +\| `([a-z0-9]+)` +\|", section, re.MULTILINE))
    specs = base.registered_codecs()
    assert portable == {(s.versioned, s.user_name) for s in specs if s.cpu_readable}
    reserved = set(re.findall(r"^\| `(nvcomp\.[a-z]+/1)` +\| `([a-z]+)` +\|", section, re.MULTILINE))
    assert reserved == {(s.versioned, s.user_name) for s in specs if s.requires_gpu and s.user_name}
    assert set(base.PORTABLE_CODECS) == {u for _, u in portable}
    assert "byteplanes/1" in base._TRANSFORMS


def test_limits_match_library() -> None:
    from gdsckpt.format import index, layout

    assert index.MAX_CHUNK_RAW_BYTES == 2 ** 30 and "`raw <= 2^30` (1 GiB) per chunk" in DOC
    assert index.MAX_EXPANSION == 65536 and "`raw <= 65536 * max(stored, 1)`" in DOC
    assert index.MAX_TENSOR_BYTES == 2 ** 60 and "<= 2^60" in DOC
    assert index.MAX_TREE_DEPTH == 512 and "no node's depth may exceed **512**" in DOC
    assert index.MAX_CHAIN_STAGES == 8 and "A chain has at most **8** stages" in DOC
    assert index.PLANE_WIDTHS == (2, 4, 8) and "one of 2, 4 or 8" in _section("### 9.2 `byteplanes/1`")
    assert layout.MAX_INDEX_BYTES == 2 ** 30 and "`index_length <= 2^30` (1 GiB)" in DOC
    assert index.TENSOR_KINDS == ("torch", "numpy", "cupy", "jax")
    assert index._CODEC_NAME.pattern == r"[a-z0-9_.\-]+/[0-9]+" and "`[a-z0-9_.\\-]+/[0-9]+`" in DOC
    assert "`-?[0-9]{1,4300}`" in DOC and "`[0-9a-f]{16}`" in DOC


def _hex_block(after: str) -> bytes:
    block = DOC[DOC.index("```", DOC.index(after)) + 3:]
    block = block[block.index("\n") + 1:block.index("```")]
    return bytes.fromhex("".join(" ".join(line.split()[1:17]) for line in block.splitlines()))


def test_worked_example_header() -> None:
    from gdsckpt.format import pack_header

    assert _hex_block("The header of every v1.0 file") == pack_header()[:64]
    assert "ending in CRC `0x10DF6BB4`" in DOC and pack_header()[60:64] == (0x10DF6BB4).to_bytes(4, "little")


def test_worked_example_file(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import gdsckpt

    w = torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.0, -0.25]], dtype=torch.bfloat16)
    state = {"w": w, "tied": w, "step": 5, "lr": 0.001, "cfg": ("adam", [True, None])}
    path = tmp_path / "example.gdsckpt"
    gdsckpt.save(state, path, config=gdsckpt.Config(codec="none", fsync=False))
    data = path.read_bytes()
    parsed = spec.parse_file(data)
    section = _section("## 16. Worked example")
    shown = section[section.index("```json") + 7:]
    shown_doc = json.loads(shown[:shown.index("```")])
    assert shown_doc == parsed.index | {"writer": "gdsckpt 0.1.0"}
    assert data[4096:4108] == bytes.fromhex("803f00c0003f4040000080be")
    assert spec.byteplanes_forward(data[4096:4108], 2) == bytes.fromhex("3fc03f4000be800000400080")
    if parsed.index["writer"] == "gdsckpt 0.1.0":  # sizes in the text are those of that writer string
        assert len(data) == 8973 and parsed.trailer["index_length"] == 717
        assert _hex_block("and the trailer:") == data[-64:]
