"""Index members the reader interpreted more loosely than docs/format.md says, and valid files it
refused (found by a conformance pass against the spec).

- Two NaN keys in one dict: distinct keys to Python, one key path to a checkpoint. The writer
  saved such a dict, and every reader then refused the file as corrupt, so
  ``restore_latest`` passed over that newest step (§7.1).
- A process that lowered Python's int-to-text limit (``sys.set_int_max_str_digits``) could not
  read a valid file holding a long int (§7.2 allows 4,300 digits): a bare ``ValueError``.
- ``"alignment": 4096.0`` was accepted (§6.1: integers have no fraction); a ``lossy`` member with
  ``max_error`` above ``abs_bound``, or a bound too large for a float, was accepted (the CLI then
  failed with ``OverflowError``) (§6.5); ``requires_grad`` and ``scalar`` were read by
  truthiness (``"no"`` made a Parameter that requires grad).

Files are real checkpoints whose index is rewritten with its checksums repaired
(``test_hostile_index.rewrite_index``), so only the validators can object.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt.errors import CorruptCheckpointError

from .test_hostile_index import rewrite_index

CONFIG = gdsckpt.Config(codec="zstd", fsync=False, codec_threads=1, io_threads=1)


def _bits(array: Any) -> bytes:
    return np.ascontiguousarray(torch.as_tensor(array).view(-1).view(torch.uint8).numpy()).tobytes()


def test_a_dict_with_two_nan_keys_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    path = tmp_path / "state.gdsckpt"
    gdsckpt.save({"w": torch.arange(4.0)}, path, config=CONFIG)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="more than one NaN key"):
        gdsckpt.save({"ids": {float("nan"): 1, float("nan"): 2}, "w": torch.ones(2)}, path, config=CONFIG)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.gdsckpt"]


def test_one_nan_key_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "state.gdsckpt"
    gdsckpt.save({"ids": {float("nan"): torch.ones(3), 1.5: 2}}, path, config=CONFIG)
    ((key, value), (other, two)) = gdsckpt.load(path, config=CONFIG)["ids"].items()
    assert math.isnan(key) and _bits(value) == _bits(torch.ones(3)) and (other, two) == (1.5, 2)


def test_a_file_with_two_nan_keys_is_corrupt(tmp_path: Path) -> None:
    """Another writer's file (or an older gdsckpt's) with two NaN keys: refused as corrupt by every
    reader, naming the dict."""
    source, hostile = tmp_path / "ok.gdsckpt", tmp_path / "nan.gdsckpt"
    gdsckpt.save({"ids": {float("nan"): 1, 2.5: 2}}, source, config=CONFIG)

    def second_nan(doc: dict[str, Any]) -> None:
        items = doc["tree"]["items"][0][1]["items"]
        items[1][0] = dict(items[0][0])
    rewrite_index(source, hostile, second_nan)
    for read in (gdsckpt.load, gdsckpt.open, gdsckpt.inspect, gdsckpt.verify):
        with pytest.raises(CorruptCheckpointError, match="repeats a key"):
            read(hostile, config=CONFIG)


LONG_INT_CHILD = """
import sys
import gdsckpt, torch
path, mode = sys.argv[1], sys.argv[2]
value = 7 * 10 ** 700 + 1
state = {"seed": -value, "ids": {value: "x"}, "w": torch.ones(2)}
if mode == "save-low":
    sys.set_int_max_str_digits(640)
gdsckpt.save(state, path, config=gdsckpt.Config(fsync=False))
sys.set_int_max_str_digits(640)
back = gdsckpt.load(path)
assert back["seed"] == -value and list(back["ids"]) == [value] and back["ids"][value] == "x", back.keys()
with gdsckpt.open(path) as ckpt:
    assert ckpt.get("w").tolist() == [1.0, 1.0]
assert gdsckpt.inspect(path).tensors and gdsckpt.verify(path).chunks >= 1
print("ok")
"""


@pytest.mark.parametrize("mode", ["save-default", "save-low"])
def test_long_ints_under_a_lowered_int_text_limit(mode: str, tmp_path: Path) -> None:
    """A child process (the limit is process-wide) lowers it to Python's least, 640 digits, before
    loading a 701-digit int value and dict key, saved at the default limit or the lowered one."""
    child = subprocess.run([sys.executable, "-c", LONG_INT_CHILD, str(tmp_path / "long.gdsckpt"), mode],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr[-2000:]


def _set(member: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc[member] = value
    return edit


def _record(key: str, **members: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        record = next(record for record in doc["tensors"] if record["key"] == key)
        record.update(members)
    return edit


@pytest.fixture(scope="module")
def plain_file(tmp_path_factory: Any) -> Path:
    path = tmp_path_factory.mktemp("conformance") / "plain.gdsckpt"
    gdsckpt.save({"p": torch.nn.Parameter(torch.ones(4)), "s": np.float32(2.5), "w": torch.arange(3.0)},
                 path, config=CONFIG)
    return path


LOSSY = {"mode": "grid", "rel_bound": 0.01, "abs_bound": 2.5e-05, "max_error": 1.9e-05}
REFUSED: dict[str, Callable[[dict[str, Any]], None]] = {
    "alignment 4096.0": _set("alignment", 4096.0),
    "alignment true": _set("alignment", True),
    "lossy max_error above abs_bound": _record("w", lossy={**LOSSY, "max_error": 3e-05}),
    "lossy bound of 400 digits": _record("w", lossy={**LOSSY, "abs_bound": 10 ** 400, "max_error": 0}),
    "requires_grad 'no'": _record("p", parameter={"requires_grad": "no"}),
    "requires_grad 1": _record("p", parameter={"requires_grad": 1}),
    "scalar 'no'": _record("s", scalar="no"),
    "scalar 1": _record("s", scalar=1),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_members_the_spec_types_strictly_are_refused(case: str, plain_file: Path, tmp_path: Path) -> None:
    hostile = tmp_path / "hostile.gdsckpt"
    rewrite_index(plain_file, hostile, REFUSED[case])
    with pytest.raises(CorruptCheckpointError):
        gdsckpt.load(hostile, config=CONFIG)
    cli = subprocess.run([sys.executable, "-m", "gdsckpt", "inspect", str(hostile)],
                         capture_output=True, text=True, timeout=120)
    assert "Traceback" not in cli.stderr, cli.stderr[-2000:]


def test_the_strict_members_written_as_the_spec_says_still_load(plain_file: Path, tmp_path: Path) -> None:
    """The same members well-formed: an integer alignment, a lossy member at its bound, booleans."""
    path = tmp_path / "fine.gdsckpt"

    def edit(doc: dict[str, Any]) -> None:
        doc["alignment"] = 4096
        _record("w", lossy={**LOSSY, "max_error": LOSSY["abs_bound"]})(doc)
        _record("p", parameter={"requires_grad": False})(doc)
        _record("s", scalar=False)(doc)
    rewrite_index(plain_file, path, edit)
    with pytest.warns(gdsckpt.LossyWarning):
        state = gdsckpt.load(path, config=CONFIG)
    assert isinstance(state["p"], torch.nn.Parameter) and not state["p"].requires_grad
    assert isinstance(state["s"], np.ndarray) and state["s"].shape == () and state["s"] == np.float32(2.5)


def test_the_format_knows_every_registered_codec_as_a_codec() -> None:
    """The parser's list of §9.1 codecs (which only ever end a chain) and the codec registry name
    the same bitstreams: a codec registered but missing from the list would be accepted anywhere
    in a chain, one listed but not registered is a name the spec and the code disagree on."""
    from gdsckpt.codecs import registered_codecs
    from gdsckpt.format.index import V1_CODECS

    assert {spec.versioned for spec in registered_codecs()} == set(V1_CODECS)
