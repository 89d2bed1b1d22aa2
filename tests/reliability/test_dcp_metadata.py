"""Opening a gdsckpt DCP checkpoint runs no code from the directory.

``GdsStorageWriter`` writes DCP's ``Metadata`` twice: as JSON (``.metadata.json``, decoded with
``json`` and a strict schema) and, last, as DCP's pickle (``.metadata``, for torch's own
``FileSystemReader``). ``GdsStorageReader`` reads the JSON; it unpickles ``.metadata`` only with
``trust_pickle=True``, and hands DCP's byte items to the planner (which unpickles them with
``torch.load(weights_only=False)``) only once torch's ``weights_only`` loader accepted them.
Here the reader runs with every unpickling entry point of ``pickle`` and ``_pickle`` replaced by a
function that raises (fault injection); crafted ``.metadata`` pickles and byte items whose
unpickling would create a marker file leave no marker; hostile JSON gets a ``CheckpointError``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

import gdsckpt
from gdsckpt.dcp import (
    GdsStorageInfo,
    GdsStorageReader,
    GdsStorageWriter,
    PickleOnlyMetadataWarning,
    item_key,
)
from gdsckpt.errors import CheckpointError, CorruptCheckpointError

from .harness import record_figure
from .test_no_pickle import Payload, refuse_unpickling

DISABLED = r"torch\.distributed is disabled"  # torch's warning for DCP in a process without a group
OPTIONS = {"chunk_bytes": 4096, "codec_threads": 1, "io_threads": 2, "fsync": False}


def bits(tensor: Any) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def training_state() -> dict[str, Any]:
    """Tensors with NaN payloads and -0.0, a bfloat16 and a non-contiguous one, Adam's nested
    optimizer state, and byte items (an int, a str, a tuple)."""
    torch.manual_seed(3)
    model = torch.nn.Linear(5, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 5)).sum().backward()
    optimizer.step()
    odd = torch.tensor([0.0, -0.0, 1.0, 2.0], dtype=torch.float32)
    odd.view(torch.int32)[2] = 0x7FC00123  # a NaN with a payload
    odd.view(torch.int32)[3] = -0x0040_0001  # a negative NaN with another payload
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "odd": odd,
            "half": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
            "t": torch.arange(20).reshape(4, 5).t(), "step": 7, "name": "run-α", "pair": (1, 2.5)}


def empty_like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: empty_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [empty_like(v) for v in state]
    return None if not isinstance(state, (int, float, str, tuple)) else type(state)()


def assert_same(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and bits(got) == bits(want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        assert got == want and type(got) is type(want)


def save(state: dict[str, Any], path: Path) -> None:
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.save(state, storage_writer=GdsStorageWriter(path, codec="zstd", **OPTIONS))


def load(target: dict[str, Any], reader: GdsStorageReader) -> None:
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.load(target, storage_reader=reader)


def without_load_id(metadata: Metadata) -> Metadata:
    metadata.storage_meta.load_id = None
    return metadata


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("dcp") / "ck"
    state = training_state()
    save(state, path)
    return path, state


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for entry in src.iterdir():
        (dst / entry.name).write_bytes(entry.read_bytes())
    return dst


# ---------------------------------------------------------------------------------------------
# the JSON path

def test_layout_and_round_trip_bit_exact(saved: tuple[Path, dict[str, Any]]) -> None:
    path, state = saved
    (rank_file,) = path.glob("__0_*.gdsckpt")  # its name carries the save's file id
    assert sorted(os.listdir(path)) == [".metadata", ".metadata.json", rank_file.name]
    target = empty_like(state)
    load(target, GdsStorageReader(path))
    assert_same(target, state)


def test_metadata_is_read_without_unpickling(saved: tuple[Path, dict[str, Any]],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path, state = saved
    with open(path / ".metadata", "rb") as f:
        pickled = pickle.load(f)
    calls = refuse_unpickling(monkeypatch)
    started = time.perf_counter()
    metadata = GdsStorageReader(path).read_metadata()
    elapsed = time.perf_counter() - started
    # a load of the tensors (no byte items, which DCP's planner itself unpickles) runs no unpickler
    target = {"model": empty_like(state["model"]), "odd": torch.zeros(4),
              "t": torch.zeros(5, 4, dtype=torch.int64)}
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    with pytest.warns(UserWarning, match=DISABLED):
        dcp.load(target, storage_reader=GdsStorageReader(path),
                 planner=DefaultLoadPlanner(allow_partial_load=True))
    monkeypatch.undo()
    assert calls == []
    assert_same(target["model"], state["model"])
    assert bits(target["odd"]) == bits(state["odd"]) and bits(target["t"]) == bits(state["t"])
    # the JSON holds exactly what the pickle holds, field by field
    assert without_load_id(metadata) == pickled
    assert metadata.planner_data == pickled.planner_data and metadata.storage_meta == pickled.storage_meta
    for index, info in metadata.storage_data.items():
        assert info == pickled.storage_data[index] and isinstance(info, GdsStorageInfo)
    record_figure("dcp_metadata_json", f"{len(metadata.state_dict_metadata)} entries, "
                  f"{(path / '.metadata.json').stat().st_size} B of JSON read in {elapsed * 1e3:.1f} ms")


def sharded_metadata(path: Path) -> tuple[Metadata, list[list[WriteResult]]]:
    """Metadata of a tensor saved as four row shards by two ranks (as DTensor Shard(0) writes)."""
    props = TensorProperties(dtype=torch.float8_e4m3fn, requires_grad=True)
    chunks = [ChunkStorageMetadata(offsets=torch.Size([row, 0]), sizes=torch.Size([2, 3]))
              for row in (0, 2, 4, 6)]
    md = Metadata(state_dict_metadata={"w": TensorStorageMetadata(props, torch.Size([8, 3]), chunks)},
                  planner_data={"w": ("w",), "x.0": ("x", 0)})
    results = [[WriteResult(index=MetadataIndex("w", c.offsets, i), size_in_bytes=6,
                            storage_data=GdsStorageInfo(f"__{i // 2}_0.gdsckpt",
                                                        item_key(MetadataIndex("w", c.offsets)), 6))
                for i, c in enumerate(chunks) if i // 2 == rank] for rank in (0, 1)]
    return md, results


def test_sharded_chunk_metadata_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    md, results = sharded_metadata(tmp_path)
    GdsStorageWriter(tmp_path, **OPTIONS).finish(md, results)
    with open(tmp_path / ".metadata", "rb") as f:
        pickled = pickle.load(f)
    refuse_unpickling(monkeypatch)
    decoded = without_load_id(GdsStorageReader(tmp_path).read_metadata())
    assert decoded == pickled
    assert decoded.state_dict_metadata["w"].properties.dtype == torch.float8_e4m3fn
    assert [index.index for index in decoded.storage_data] == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------
# pickles: never unpickled unless trusted

def test_crafted_pickle_metadata_is_not_run(tmp_path: Path, caplog: pytest.LogCaptureFixture, h: Any) -> None:
    marker = tmp_path / "marker"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"trust_pickle=True"):
        GdsStorageReader(tmp_path).read_metadata()
    with h.dcp_load_fails_saying(caplog, r"trust_pickle=True"), pytest.warns(UserWarning, match=DISABLED):
        dcp.load({"w": torch.zeros(2)}, storage_reader=GdsStorageReader(tmp_path))
    assert not marker.exists()


def test_json_that_does_not_describe_the_pickle_is_refused(saved: tuple[Path, dict[str, Any]],
                                                           tmp_path: Path) -> None:
    # another writer replaced .metadata, leaving an older .metadata.json behind: that JSON is stale
    path = copy_checkpoint(saved[0], tmp_path / "ck")
    marker = tmp_path / "marker"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata\.json.*does not describe"):
        GdsStorageReader(path).read_metadata()
    assert not marker.exists()


def test_pickle_only_directory_needs_trust(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path = copy_checkpoint(saved[0], tmp_path / "legacy")
    (path / ".metadata.json").unlink()  # as written by earlier gdsckpt versions
    with pytest.raises(CheckpointError, match=r"only the pickled \.metadata.*trust_pickle=True"):
        GdsStorageReader(path).read_metadata()
    target = empty_like(saved[1])
    load(target, GdsStorageReader(path, trust_pickle=True))
    assert_same(target, saved[1])


def test_metadata_missing_is_not_a_checkpoint(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path = copy_checkpoint(saved[0], tmp_path / "ck")
    (path / ".metadata").unlink()  # the JSON alone: a save that stopped before committing
    for trust in (False, True):
        with pytest.raises(CheckpointError, match=r"no \.metadata"):
            GdsStorageReader(path, trust_pickle=trust).read_metadata()


def test_crafted_byte_item_is_not_run(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    # DCP's planner unpickles byte items with torch.load(weights_only=False): the reader lets
    # through only what torch's weights_only loader accepts
    path = copy_checkpoint(saved[0], tmp_path / "ck")
    marker = tmp_path / "marker"
    (rank_file,) = path.glob("__0_*.gdsckpt")
    flat = gdsckpt.load(rank_file)
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    flat["step@"] = torch.frombuffer(bytearray(payload.getvalue()), dtype=torch.uint8)
    gdsckpt.save(flat, rank_file)
    with pytest.raises(CheckpointException, match=r"byte item 'step'.*trust_pickle=True"), \
            pytest.warns(UserWarning, match=DISABLED):
        dcp.load(empty_like(saved[1]), storage_reader=GdsStorageReader(path))
    assert not marker.exists()


def test_metadata_json_cannot_express_writes_the_pickle_only(tmp_path: Path) -> None:
    save({"w": torch.ones(3)}, tmp_path)  # a complete checkpoint with JSON first
    md, results = sharded_metadata(tmp_path)
    md.planner_data = {"w": {"a set", "is not JSON"}}  # a custom planner's own data
    with pytest.warns(PickleOnlyMetadataWarning, match=r"planner_data.*trust_pickle=True"):
        GdsStorageWriter(tmp_path, **OPTIONS).finish(md, results)
    assert not (tmp_path / ".metadata.json").exists()  # the old JSON went too
    with pytest.raises(CheckpointError, match=r"trust_pickle=True"):
        GdsStorageReader(tmp_path).read_metadata()
    assert GdsStorageReader(tmp_path, trust_pickle=True).read_metadata().planner_data == md.planner_data


# ---------------------------------------------------------------------------------------------
# hostile JSON

def _doc(path: Path) -> dict[str, Any]:
    return json.loads((path / ".metadata.json").read_text())


def _tensor_entry(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["state_dict_metadata"]["model.weight"]


def _set(func: Any) -> Any:
    def edit(doc: dict[str, Any]) -> dict[str, Any]:
        func(doc)
        return doc
    return edit


HOSTILE: dict[str, tuple[Any, str]] = {
    "size_wrong_type": (_set(lambda d: _tensor_entry(d).update(size="3,5")), r"model\.weight.*size"),
    "size_bool": (_set(lambda d: _tensor_entry(d).update(size=[True, 5])), r"size"),
    "size_huge": (_set(lambda d: _tensor_entry(d).update(size=[2 ** 70, 5])), r"size"),
    "size_negative": (_set(lambda d: _tensor_entry(d).update(size=[-1, 5])), r"size"),
    "numel_huge": (_set(lambda d: _tensor_entry(d).update(size=[2 ** 40] * 3)), r"elements"),
    "unknown_dtype": (_set(lambda d: _tensor_entry(d).update(dtype="float128")), r"dtype.*float128"),
    "dtype_not_str": (_set(lambda d: _tensor_entry(d).update(dtype=["float32"])), r"dtype"),
    "unknown_layout": (_set(lambda d: _tensor_entry(d).update(layout="os.system")), r"layout"),
    "chunk_outside": (_set(lambda d: _tensor_entry(d)["chunks"][0].update(offsets=[1, 0])), r"chunk 0"),
    "chunk_rank": (_set(lambda d: _tensor_entry(d)["chunks"][0].update(sizes=[3])), r"chunk 0"),
    "unknown_kind": (_set(lambda d: d["state_dict_metadata"].update(step={"type": "pickle"})), r"step.*type"),
    "unknown_field": (_set(lambda d: d.update(__reduce__="exec")), r"__reduce__"),
    "missing_field": (_set(lambda d: d.pop("storage_data")), r"storage_data"),
    "schema": (_set(lambda d: d.update(schema=2)), r"schema"),
    "format": (_set(lambda d: d.update(format="pickle")), r"format"),
    "planner_path_float": (_set(lambda d: d["planner_data"].update(step=["step", 1.5])), r"planner_data"),
    "storage_path_escape": (_set(lambda d: d["storage_data"][0].update(file="../x.gdsckpt")), r"file"),
    "storage_unknown_fqn": (_set(lambda d: d["storage_data"][0].update(fqn="nope")), r"nope"),
    "storage_duplicate": (_set(lambda d: d["storage_data"].append(dict(d["storage_data"][0]))), r"twice"),
    "storage_length": (_set(lambda d: d["storage_data"][0].update(length=-3)), r"length"),
    "digest": (_set(lambda d: d["pickle"].update(sha256="0" * 64)), r"does not describe"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_json_is_refused(saved: tuple[Path, dict[str, Any]], tmp_path: Path, case: str) -> None:
    edit, message = HOSTILE[case]
    path = copy_checkpoint(saved[0], tmp_path / "ck")
    (path / ".metadata.json").write_text(json.dumps(edit(_doc(path))))
    with pytest.raises(CheckpointError, match=message):
        GdsStorageReader(path).read_metadata()


@pytest.mark.parametrize("text, message", [
    ("[" * 100_000 + "]" * 100_000, r"nesting too deep"),
    ('{"a": NaN}', r"not valid UTF-8 JSON"),
    ('{"a": 1, "a": 2}', r"duplicate key 'a'"),
    ("1" * 5000, r"not valid UTF-8 JSON"),
    ("", r"not valid UTF-8 JSON"),
    ("[]", r"not a gdsckpt DCP metadata object"),
], ids=["deep_nesting", "nan", "duplicate_key", "int_5000_digits", "empty", "not_an_object"])
def test_malformed_json_is_refused(saved: tuple[Path, dict[str, Any]], tmp_path: Path, text: str,
                                   message: str) -> None:
    path = copy_checkpoint(saved[0], tmp_path / "ck")
    (path / ".metadata.json").write_text(text)
    with pytest.raises(CorruptCheckpointError, match=message):
        GdsStorageReader(path).read_metadata()
    (path / ".metadata.json").write_bytes(b'{"format": "\xff"}')
    with pytest.raises(CorruptCheckpointError, match=r"not valid UTF-8 JSON"):
        GdsStorageReader(path).read_metadata()
