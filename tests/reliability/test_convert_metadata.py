"""A safetensors file's ``gdsckpt.structure`` metadata is validated as strictly as a gdsckpt index.

``convert`` rebuilds a nested state from that JSON document. Every node must be exactly what the
writer emits (kinds, fields, scalar encodings: a float is 16 hex digits of its bits, a bool a
JSON boolean, an int a decimal string), the tree must reference each tensor entry once and the
entries each tensor of the file once. Anything else is a ``ConvertError`` (a ``CheckpointError``)
naming the file and the metadata entry, never a ``struct.error`` traceback nor a silently wrong
value (``"false"`` read as True, a dict key given twice dropping one of its values); the
command line prints one line and exits 1. A well-formed document still converts bit-exact.
"""

from __future__ import annotations

import collections
import copy
import json
import re
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import gdsckpt
from gdsckpt.cli.main import main
from gdsckpt.demo import bit_equal
from gdsckpt.integrations.convert import STRUCTURE_KEY, ConvertError, convert

safetensors = pytest.importorskip("safetensors")
safetensors_torch = pytest.importorskip("safetensors.torch")

NAN_WITH_PAYLOAD = struct.unpack(">d", bytes.fromhex("7ff8000000000123"))[0]


def _state() -> dict:
    model: collections.OrderedDict = collections.OrderedDict()
    model["w"] = torch.nn.Parameter(torch.tensor([1.5, -0.0]), requires_grad=False)
    model["tied"] = model["w"]
    model._metadata = collections.OrderedDict({"": {"version": 2}})  # type: ignore[attr-defined]
    return {"model": model, "ids": torch.arange(4), "lr": 0.5, "nan": NAN_WITH_PAYLOAD, "zero": -0.0,
            "flag": False, "on": True, "n": -3, "name": "adam", "none": None, "seq": [1, (2.5, True)],
            7: "int key"}


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and the parsed structure document of a well-formed conversion of ``_state``."""
    directory = tmp_path_factory.mktemp("good")
    torch.save(_state(), directory / "src.pt")
    convert(directory / "src.pt", directory / "good.safetensors")
    with safetensors.safe_open(str(directory / "good.safetensors"), framework="pt") as handle:
        doc = json.loads(handle.metadata()[STRUCTURE_KEY])
    return safetensors_torch.load_file(str(directory / "good.safetensors")), doc


def _nodes(node: Any) -> Any:
    """Every structure node of a tree (dict keys included), depth first."""
    yield node
    if node["t"] in ("list", "tuple"):
        for child in node["items"]:
            yield from _nodes(child)
    elif node["t"] == "dict":
        for key, child in node["items"]:
            yield key
            yield from _nodes(child)
        if "meta" in node:
            yield from _nodes(node["meta"])


def _first(doc: dict, kind: str) -> dict:
    return next(node for node in _nodes(doc["tree"]) if node["t"] == kind)


def _set(kind: str, **fields: Any) -> Callable[[dict], None]:
    return lambda doc: _first(doc, kind).update(fields)


def _nest(depth: int) -> Callable[[dict], None]:
    """A value ``depth`` lists deep (a marker node here, spelled out by ``_write``: json.dumps
    itself cannot write the deepest)."""
    marker = {"t": "str", "v": f"@NEST{depth}@"}
    return lambda doc: doc["tree"]["items"].append([{"t": "str", "v": "deep"}, marker])


def _duplicate_key(doc: dict) -> None:
    items = doc["tree"]["items"]
    name_item = next(item for item in items if item[0] == {"t": "str", "v": "name"})
    items.append([dict(name_item[0]), {"t": "str", "v": "sgd"}])  # "name" twice: one value lost


def _duplicate_entry(doc: dict) -> None:
    doc["tensors"].append(dict(doc["tensors"][0]))
    doc["tree"]["items"].append([{"t": "str", "v": "again"}, {"t": "tensor", "id": len(doc["tensors"]) - 1}])


MALFORMED: dict[str, Callable[[dict], None]] = {
    "float too short": _set("float", v="3ff0"),  # was a struct.error traceback
    "float not hex": _set("float", v="zzzzzzzzzzzzzzzz"),
    "float as a JSON number": _set("float", v=0.5),
    "bool as a string": _set("bool", v="false"),  # was converted as True
    "bool as a number": _set("bool", v=0),
    "int as a JSON number": _set("int", v=-3),
    "int not decimal": _set("int", v="0x10"),
    "str not a string": _set("str", v=5),
    "unknown kind": _set("list", t="set"),
    "node without a kind": lambda doc: doc["tree"]["items"].append([{"t": "str", "v": "x"}, {"v": 1}]),
    "list without items": lambda doc: _first(doc, "list").pop("items"),
    "dict item not a pair": lambda doc: doc["tree"]["items"].append([{"t": "str", "v": "x"}]),
    "dict key a container": lambda doc: doc["tree"]["items"].append(
        [{"t": "list", "items": []}, {"t": "none"}]),
    "dict key given twice": _duplicate_key,
    "unknown dict class": lambda doc: doc["tree"].update(cls="defaultdict"),
    "tensor in an OrderedDict's meta": lambda doc: _first(doc, "dict")["items"][0][1]["meta"]["items"].append(
        [{"t": "str", "v": "x"}, {"t": "tensor", "id": 0}]),
    "tensor id out of range": _set("tensor", id=99),
    "tensor id a bool": _set("tensor", id=False),
    "tensor referenced twice": lambda doc: doc["tree"]["items"].append(
        [{"t": "str", "v": "x"}, {"t": "tensor", "id": 0}]),
    "tensor entry named twice": _duplicate_entry,
    "entry naming a missing tensor": lambda doc: doc["tensors"][0].update(name="nowhere"),
    "entry without a name": lambda doc: doc["tensors"][0].pop("name"),
    "entry with an unknown field": lambda doc: doc["tensors"][0].update(device="cuda"),
    "alias to a later entry": lambda doc: doc["tensors"][0].update(alias=1),
    "alias a bool": lambda doc: next(e for e in doc["tensors"] if "alias" in e).update(alias=True),
    "requires_grad as a string": lambda doc: doc["tensors"][0].update(parameter={"requires_grad": "false"}),
    "requires_grad on an int tensor": lambda doc: next(
        e for e in doc["tensors"] if e["name"] == "ids").update(parameter={"requires_grad": True}),
    "version a bool": lambda doc: doc.update(version=True),
    "unknown top-level field": lambda doc: doc.update(extra=1),
    "tensors not a list": lambda doc: doc.update(tensors={}),
    "nested past the limit": _nest(600),
    "nested past the JSON parser": _nest(100_000),
}


def _write(path: Path, tensors: dict[str, torch.Tensor], doc: dict) -> Path:
    text = json.dumps(doc, separators=(",", ":"))
    marker = re.search(r'\{"t":"str","v":"@NEST([0-9]+)@"\}', text)
    if marker:
        depth = int(marker.group(1))
        text = text.replace(marker.group(0), '{"t":"list","items":[' * depth + '{"t":"none"}' + "]}" * depth)
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt", STRUCTURE_KEY: text})
    return path


def _malformed(tmp_path: Path, good: Any, case: str) -> Path:
    tensors, doc = good
    doc = copy.deepcopy(doc)
    MALFORMED[case](doc)
    return _write(tmp_path / "bad.safetensors", tensors, doc)


def test_well_formed_structure_converts_bit_exact(tmp_path: Path, good: Any) -> None:
    source = _write(tmp_path / "good.safetensors", *good)
    expected = _state()
    for dst in (tmp_path / "back.pt", tmp_path / "back.gdsckpt"):
        convert(source, dst)
        back = torch.load(dst, weights_only=True) if dst.suffix == ".pt" else gdsckpt.load(dst)
        assert back.keys() == expected.keys()
        for key, value in expected.items():
            if key == "model":
                assert bit_equal(back[key]["w"], value["w"]) and back[key]["tied"] is back[key]["w"]
                assert back[key]._metadata == value._metadata
            elif isinstance(value, torch.Tensor):
                assert bit_equal(back[key], value)
            elif isinstance(value, float):
                assert struct.pack(">d", back[key]) == struct.pack(">d", value), key  # NaN payload, -0.0
            else:
                assert back[key] == value and type(back[key]) is type(value), key
        assert back["flag"] is False and back["on"] is True


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_structure_is_a_clear_error(tmp_path: Path, good: Any, case: str) -> None:
    source = _malformed(tmp_path, good, case)
    dst = tmp_path / "out.pt"
    with pytest.raises(ConvertError, match=rf"bad\.safetensors.*{STRUCTURE_KEY}"):
        convert(source, dst)
    assert not dst.exists()


def test_command_line_prints_one_line(tmp_path: Path, good: Any) -> None:
    source = _malformed(tmp_path, good, "float too short")
    dst = tmp_path / "out.gdsckpt"
    result = subprocess.run([sys.executable, "-m", "gdsckpt", "convert", str(source), str(dst)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("gdsckpt convert: error:") and STRUCTURE_KEY in lines[0]
    assert not dst.exists()


@pytest.mark.parametrize("case", list(MALFORMED))
def test_command_line_reports_every_case_in_one_line(tmp_path: Path, good: Any, case: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The command's entry point in this process (an exception escaping it would fail the test)."""
    source = _malformed(tmp_path, good, case)
    dst = tmp_path / "out.gdsckpt"
    assert main(["--quiet", "convert", str(source), str(dst)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gdsckpt convert: error:"), lines
    assert STRUCTURE_KEY in lines[0] and not dst.exists()
