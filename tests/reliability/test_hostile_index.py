"""Hostile index fields that pass a naive validation but make a reader stall or crash.

- Codec chains: each transform stage is a full pass over a chunk's decoded bytes, so a chain of
  thousands of ``byteplanes/1`` stages kept a 174 KiB file busy for minutes. docs/format.md
  (§6.3) bounds chains at 8 stages, forbids a stage named twice, and fixes ``byteplanes/1``'s
  parameters; readers refuse other chains when they open the file.
- Alias records (§6.7): an alias of another kind of array, or a ``parameter`` member that the
  alias's dtype cannot hold, raised ``AttributeError`` / ``RuntimeError`` from ``load`` and
  ``open().get`` and made ``CheckpointManager.restore_latest`` raise instead of skipping the file.

Files are real checkpoints whose index is rewritten (checksums repaired), so the damage reaches
the validators behind the checksums.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt.errors import CheckpointError, CorruptCheckpointError, UnsupportedFormatError
from gdsckpt.format import checksum, pack_trailer, unpack_trailer
from gdsckpt.manager import SkippedCheckpointWarning

from .harness import record_figure

MAX_CHAIN_STAGES = 8
"""docs/format.md §6.3: readers refuse longer chains."""
CONFIG = gdsckpt.Config(codec="zstd", fsync=False, codec_threads=1, io_threads=1)


def rewrite_index(source: Path, target: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Copy ``source`` to ``target`` with its index JSON passed through ``edit`` (index CRC and
    trailer recomputed, so only the validators can object)."""
    data = source.read_bytes()
    trailer = unpack_trailer(data[-64:], len(data))
    doc = json.loads(data[trailer.index_offset:trailer.index_offset + trailer.index_length])
    edit(doc)
    index = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    target.write_bytes(data[:trailer.index_offset] + index
                       + pack_trailer(trailer.index_offset, len(index), checksum(index), trailer.minor))


def small_state() -> dict[str, Any]:
    """Arrays of each kind the aliases below point at (all in one chunk: the state fits a page)."""
    return {"i": torch.arange(6), "n": np.arange(6, dtype=np.int64),
            "f": torch.nn.Parameter(torch.ones(6)), "h": torch.zeros(3, dtype=torch.bfloat16), "step": 1}


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: Any) -> Path:
    path = tmp_path_factory.mktemp("hostile-index") / "small.gdsckpt"
    gdsckpt.save(small_state(), path, config=CONFIG)
    return path


def _record_id(doc: dict[str, Any], key: str) -> int:
    return [record["key"] for record in doc["tensors"]].index(key)


# ---------------------------------------------------------------------------------------------
# chains

STALL_CHILD = textwrap.dedent("""
    import json, sys, time
    import gdsckpt
    path, results = sys.argv[1], {}
    for name, operation in [("open", lambda: gdsckpt.open(path).close()),
                            ("load", lambda: gdsckpt.load(path)), ("verify", lambda: gdsckpt.verify(path))]:
        start = time.perf_counter()
        try:
            operation()
            outcome = "ok"
        except gdsckpt.CheckpointError as err:
            outcome = f"{type(err).__name__}: {err}"
        results[name] = [outcome, time.perf_counter() - start]
    print(json.dumps(results))
""")


def test_chain_of_5000_stages_is_refused_at_open(tmp_path: Path) -> None:
    """The report's file: 16 MiB of zeros in one zstd chunk (about 500 stored bytes), its chain
    rewritten to 5,000 byteplanes/1 stages before zstd/1. Unbounded, every load or verify made
    5,000 passes over 16 MiB (minutes); a subprocess with a 10 s guard keeps the test from hanging."""
    zeros = tmp_path / "zeros.gdsckpt"
    gdsckpt.save({"w": torch.zeros(1 << 23, dtype=torch.bfloat16)}, zeros,
                 config=gdsckpt.Config(codec="zstd", chunk_bytes=16 << 20, fsync=False))
    hostile = tmp_path / "long-chain.gdsckpt"

    def lengthen(doc: dict[str, Any]) -> None:
        for chain in doc["chains"]:
            chain[:] = [{"name": "byteplanes/1", "width": 2}] * 5000 + [chain[-1]]

    rewrite_index(zeros, hostile, lengthen)
    try:
        child = subprocess.run([sys.executable, "-c", STALL_CHILD, str(hostile)], capture_output=True,
                               text=True, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("open/load/verify of a 5,000-stage chain ran past 10 s")
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout)
    for name, (outcome, _seconds) in results.items():
        assert outcome.startswith("CorruptCheckpointError") and "chain 0" in outcome, (name, outcome)
    record_figure("chain of 5,000 stages",
                  f"a {hostile.stat().st_size / 1024:.0f} KiB file whose chain has 5,000 byteplanes/1 "
                  f"stages: refused at open in {results['open'][1] * 1e3:.0f} ms "
                  f"(load {results['load'][1] * 1e3:.0f} ms, verify {results['verify'][1] * 1e3:.0f} ms)")


def _chain_of_chunk(key: str, stages: list[dict[str, Any]]) -> Callable[[dict[str, Any]], None]:
    """Give the chunk holding ``key`` a chain of its own: ``stages``."""
    def edit(doc: dict[str, Any]) -> None:
        chunk = doc["tensors"][_record_id(doc, key)]["segments"][0][0]
        doc["chains"].append(stages)
        doc["chunks"][chunk][4] = len(doc["chains"]) - 1
    return edit


def _unused_chain(stages: list[dict[str, Any]]) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["chains"].append(stages)
    return edit


def _planes(width: Any) -> dict[str, Any]:
    return {"name": "byteplanes/1", "width": width}


ZSTD, NONE = {"name": "zstd/1"}, {"name": "none/1"}
UNKNOWN_TRANSFORMS = [{"name": f"future-transform-{n}/1"} for n in range(MAX_CHAIN_STAGES)]
BAD_CHAINS: dict[str, Callable[[dict[str, Any]], None]] = {
    "9 stages (8 distinct transforms and a codec)": _chain_of_chunk("i", UNKNOWN_TRANSFORMS + [ZSTD]),
    "9 stages in a chain no chunk uses": _unused_chain(UNKNOWN_TRANSFORMS + [ZSTD]),
    "byteplanes/1 twice": _chain_of_chunk("i", [_planes(8), _planes(8), ZSTD]),
    "zstd/1 twice": _chain_of_chunk("i", [ZSTD, ZSTD]),
    "byteplanes/1 after the codec": _chain_of_chunk("i", [ZSTD, _planes(8)]),
    "a codec before another (zstd/1, none/1)": _chain_of_chunk("i", [ZSTD, NONE]),
    "a codec before a transform and a codec": _chain_of_chunk("i", [NONE, _planes(2), ZSTD]),
    "byteplanes/1 alone": _chain_of_chunk("i", [_planes(8)]),
    "byteplanes/1 width 4 over a 6-byte chunk": _chain_of_chunk("h", [_planes(4), NONE]),
    "byteplanes/1 width 8 over a 6-byte chunk": _chain_of_chunk("h", [_planes(8), NONE]),
    **{f"byteplanes/1 width {width!r}": _chain_of_chunk("i", [_planes(width), ZSTD])
       for width in (0, 1, 3, 16, -2, 1 << 64, True, 2.0, "2", None, [2])},
    "byteplanes/1 without width": _chain_of_chunk("i", [{"name": "byteplanes/1"}, ZSTD]),
}


@pytest.mark.parametrize("case", sorted(BAD_CHAINS))
def test_malformed_chain_is_refused_at_open(case: str, small_file: Path, tmp_path: Path) -> None:
    hostile = tmp_path / "chain.gdsckpt"
    rewrite_index(small_file, hostile, BAD_CHAINS[case])
    for operation in (gdsckpt.open, gdsckpt.load, gdsckpt.verify, gdsckpt.inspect):
        with pytest.raises(CorruptCheckpointError, match=r"chain \d+"):
            operation(hostile, config=CONFIG)


def test_chain_of_the_maximum_length_still_opens(tmp_path: Path) -> None:
    """8 stages are allowed: unknown transform names fail only the chunk that uses them (§9.4).
    Every array in a chunk of its own here (``pack_below=0``): a state this small is otherwise
    packed into one chunk."""
    path, source = tmp_path / "eight.gdsckpt", tmp_path / "apart.gdsckpt"
    gdsckpt.save(small_state(), source, config=CONFIG.replace(pack_below=0))
    rewrite_index(source, path, _chain_of_chunk("i", UNKNOWN_TRANSFORMS[:MAX_CHAIN_STAGES - 1] + [ZSTD]))
    with gdsckpt.open(path, config=CONFIG) as ckpt:
        assert ckpt.get("h").view(torch.uint16).tolist() == [0, 0, 0]
        with pytest.raises(UnsupportedFormatError, match="future-transform"):
            ckpt.get("i")


def test_every_chain_the_writer_emits_is_within_the_bound(tmp_path: Path) -> None:
    """A full, a byte-planed and a delta checkpoint: the writer's chains are at most 3 stages, so
    the bound refuses no file ever written (no format version change)."""
    state = {"w": torch.randn(4096), "b": torch.randn(512).to(torch.bfloat16), "n": np.arange(100)}
    full, delta = tmp_path / "full.gdsckpt", tmp_path / "delta.gdsckpt"
    gdsckpt.save(state, full, config=CONFIG)
    state["w"] = state["w"] + 1
    gdsckpt.save(state, delta, base=full, config=CONFIG)
    chains = [label.split("+") for path in (full, delta) for label in gdsckpt.inspect(path).codecs]
    assert max(len(chain) for chain in chains) <= 3 < MAX_CHAIN_STAGES
    assert ["xorbase/1", "byteplanes/1", "zstd/1"] in chains, chains
    loaded = gdsckpt.load(delta, config=CONFIG)
    assert torch.equal(loaded["w"].view(torch.int32), state["w"].view(torch.int32))


# ---------------------------------------------------------------------------------------------
# aliases

def _alias(target: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    """Append tensor record "a": an alias of ``target`` as the writer writes one (its own kind,
    dtype, shape, device), with ``fields`` changed (None removes a member)."""
    def edit(doc: dict[str, Any]) -> None:
        number = _record_id(doc, target)
        record = {name: value for name, value in doc["tensors"][number].items()
                  if name in ("key", "kind", "dtype", "shape", "device")}
        record.update(key="a", alias=number)
        record.update(fields)
        doc["tensors"].append({name: value for name, value in record.items() if value is not None})
        doc["tree"]["items"].append([{"t": "str", "v": "a"}, {"t": "tensor", "id": len(doc["tensors"]) - 1}])
    return edit


REFUSED_AT_OPEN: dict[str, Callable[[dict[str, Any]], None]] = {
    "torch alias of a numpy array, as a Parameter": _alias("n", kind="torch",
                                                           parameter={"requires_grad": False}),
    "torch alias of a numpy array": _alias("n", kind="torch"),
    "numpy alias of a torch tensor": _alias("i", kind="numpy"),
    "jax alias of a torch tensor": _alias("i", kind="jax"),
    "cupy alias of a numpy array": _alias("n", kind="cupy"),
    "alias of itself": _alias("i", alias=4),
    "alias of a later record": _alias("i", alias=5),
    "alias of an alias": lambda doc: (_alias("i")(doc), _alias("i", key="b", alias=5)(doc)),
    "alias with another dtype": _alias("i", dtype="float64"),
    "alias with another shape": _alias("i", shape=[2, 3]),
    "alias with segments too": _alias("i", segments=[]),
}
REFUSED_AT_LOAD: dict[str, Callable[[dict[str, Any]], None]] = {
    # the rule a data record's parameter member obeys (an integer tensor cannot require grad)
    "int64 alias as a Parameter that requires grad": _alias("i", parameter={"requires_grad": True}),
}
HARMLESS: dict[str, Callable[[dict[str, Any]], None]] = {
    "numpy alias with a parameter member": _alias("n", parameter={"requires_grad": True}),
    "alias of a Parameter as a plain tensor": _alias("f"),
    "alias with a malformed parameter member": _alias("i", parameter="yes"),
    "alias naming another device": _alias("i", device="cuda:7"),
    "numpy alias marked scalar": _alias("n", scalar=True),
}


def _with_open(path: Path, read: Callable[[Any], Any]) -> Any:
    with gdsckpt.open(path, config=CONFIG) as ckpt:
        return read(ckpt)


def _every_reader(path: Path, alias_of: str = "i") -> list[str]:
    """Run each public reader on ``path``, whose record "a" is an alias of ``alias_of``; only
    ``CheckpointError`` may escape. Returns the names of the readers that raised one."""
    refused = []
    target = {key: torch.zeros_like(torch.as_tensor(value)).detach() for key, value in small_state().items()
              if key != "step"}
    operations: dict[str, Callable[[], Any]] = {
        "open().get": lambda: _with_open(path, lambda ckpt: [ckpt.get(key) for key in ckpt]),
        "open().get_many": lambda: _with_open(path, lambda ckpt: ckpt.get_many(ckpt.keys())),
        "load": lambda: gdsckpt.load(path, config=CONFIG),
        "load_into": lambda: gdsckpt.load_into(target | {"a": target[alias_of].clone()}, path, strict=False,
                                               config=CONFIG),
        "verify": lambda: gdsckpt.verify(path, config=CONFIG),
        "inspect": lambda: gdsckpt.inspect(path, config=CONFIG),
    }
    for name, operation in operations.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", gdsckpt.LossyWarning)
                operation()
        except CheckpointError as err:
            assert isinstance(err, CorruptCheckpointError) or name == "load_into", (name, err)
            refused.append(name)
    return refused


@pytest.mark.parametrize("case", sorted(REFUSED_AT_OPEN))
def test_inconsistent_alias_is_refused_at_open(case: str, small_file: Path, tmp_path: Path) -> None:
    hostile = tmp_path / "alias.gdsckpt"
    rewrite_index(small_file, hostile, REFUSED_AT_OPEN[case])
    with pytest.raises(CorruptCheckpointError, match="alias"):
        gdsckpt.open(hostile, config=CONFIG)
    assert len(_every_reader(hostile)) == 6


@pytest.mark.parametrize("case", sorted(REFUSED_AT_LOAD))
def test_alias_a_restore_cannot_build_is_corrupt(case: str, small_file: Path, tmp_path: Path) -> None:
    hostile = tmp_path / "alias.gdsckpt"
    rewrite_index(small_file, hostile, REFUSED_AT_LOAD[case])
    assert set(_every_reader(hostile)) == {"open().get", "open().get_many", "load", "load_into"}
    with pytest.raises(CorruptCheckpointError, match="Parameter"), gdsckpt.open(hostile) as ckpt:
        ckpt.get("a")


@pytest.mark.parametrize("case", sorted(HARMLESS))
def test_alias_with_ignorable_members_loads_as_its_target(case: str, small_file: Path,
                                                          tmp_path: Path) -> None:
    path = tmp_path / "alias.gdsckpt"
    rewrite_index(small_file, path, HARMLESS[case])
    alias_of = "n" if "numpy" in case else "f" if "Parameter" in case else "i"
    assert _every_reader(path, alias_of) == []
    state = gdsckpt.load(path, config=CONFIG)
    source = state[alias_of]
    assert isinstance(state["a"], np.ndarray if isinstance(source, np.ndarray) else torch.Tensor)
    assert _element_bytes(state["a"]) == _element_bytes(source)


def _element_bytes(array: Any) -> bytes:
    return (array.detach().numpy() if isinstance(array, torch.Tensor) else np.asarray(array)).tobytes()


def test_load_into_fills_a_tensor_from_an_alias_of_a_numpy_array(tmp_path: Path) -> None:
    """A file as the writer makes it (one NumPy array under two keys), restored into a torch
    tensor for the alias's key only: the bytes land in a NumPy array first (raised TypeError)."""
    table = np.array([-0.0, np.nan, 1.5, -3.25], dtype=np.float64)
    path = tmp_path / "tied.gdsckpt"
    gdsckpt.save({"first": table, "second": table}, path, config=CONFIG)
    target = {"second": torch.zeros(4, dtype=torch.float64)}
    gdsckpt.load_into(target, path, strict=False, config=CONFIG)
    assert _element_bytes(target["second"]) == table.tobytes()


def test_restore_latest_skips_files_with_hostile_aliases(tmp_path: Path) -> None:
    """Proven structural damage: restore_latest passes over both kinds of hostile alias (one
    refused at open, one when the restore builds it) and restores the older good checkpoint."""
    manager = gdsckpt.CheckpointManager(tmp_path / "run", keep_last=None, config=CONFIG)
    for step in (1, 2, 3):
        manager.save(step, {"model": {"w": torch.full((4,), float(step))}, "ids": torch.arange(6) * step,
                            "np": np.arange(6) * step})
    files = sorted((tmp_path / "run").glob("step-*.gdsckpt"))
    rewrite_index(files[1], files[1], _alias("np", kind="torch", parameter={"requires_grad": False}))
    rewrite_index(files[2], files[2], _alias("ids", parameter={"requires_grad": True}))
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4))  # type: ignore[assignment]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = manager.restore_latest(model=model)
    assert restored is not None and restored[0] == 1, restored
    skipped = [str(w.message) for w in caught if issubclass(w.category, SkippedCheckpointWarning)]
    assert len(skipped) == 2 and all("alias" in text or "Parameter" in text for text in skipped), skipped
    assert torch.equal(model.w.detach(), torch.full((4,), 1.0))
    assert _element_bytes(restored[1]["ids"]) == _element_bytes(torch.arange(6))


def test_alias_refusal_is_fast(small_file: Path, tmp_path: Path) -> None:
    """Not a pass/fail timing: the figure for docs/reliability.md."""
    hostile = tmp_path / "alias.gdsckpt"
    rewrite_index(small_file, hostile, REFUSED_AT_OPEN["torch alias of a numpy array"])
    start = time.perf_counter()
    with pytest.raises(CorruptCheckpointError):
        gdsckpt.open(hostile)
    record_figure("hostile aliases", f"{len(REFUSED_AT_OPEN)} alias records refused at open "
                  f"({(time.perf_counter() - start) * 1e3:.1f} ms each), {len(REFUSED_AT_LOAD)} at restore; "
                  f"restore_latest skips both")
