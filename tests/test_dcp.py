"""gdsckpt.dcp: torch.distributed.checkpoint save / load through GdsStorageWriter / GdsStorageReader.

Multi-rank tests spawn gloo process groups on the CPU (``torch.multiprocessing.spawn``); a
checkpoint saved at N ranks is loaded at M != N ranks, for replicated plain tensors and for
DTensors sharded with ``Shard(0)``, and compared bit-exact against the full tensors.

In this process (no process group), ``dcp.save`` / ``dcp.load`` always warn "torch.distributed is
disabled ... assuming the intent is to save/load in a single process" (torch's own UserWarning,
even with ``no_dist=True``): those tests expect it with ``pytest.warns``.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
dcp = pytest.importorskip("torch.distributed.checkpoint")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover - depends on the build
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from torch.distributed.checkpoint.api import CheckpointException

import gdsckpt
from gdsckpt.dcp import GdsStorageInfo, GdsStorageReader, GdsStorageWriter, item_key

DISABLED = r"torch\.distributed is disabled"

# the full tensors every test state is built from (rebuilt identically in every process)
SHAPES = {"rep_w": ((6, 5), torch.float32), "rep_i": ((7,), torch.int64),
          "sh_w": ((10, 6), torch.float32), "sh_h": ((9, 3), torch.bfloat16)}


def full_tensors() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1234)
    out = {}
    for name, (shape, dtype) in SHAPES.items():
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=g).to(dtype)
        else:
            out[name] = torch.randint(-2**40, 2**40, shape, generator=g, dtype=dtype)
    return out


def bits(t: Any) -> bytes:
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8).numpy().tobytes()


RANK_FILE = re.compile(r"__([0-9]+)_[0-9a-f]{32}\.gdsckpt")


def rank_files(directory: Path) -> dict[int, str]:
    """Rank -> the name of its rank file in ``directory`` (each save's names carry its file id)."""
    found: dict[int, str] = {}
    for name in os.listdir(directory):
        match = RANK_FILE.fullmatch(name)
        if match:
            assert int(match.group(1)) not in found, f"two rank files of rank {match.group(1)}: {os.listdir(directory)}"
            found[int(match.group(1))] = name
    return found


def small_options() -> dict[str, Any]:
    return {"chunk_bytes": 4096, "pack_below": 256, "codec_threads": 1, "io_threads": 2, "fsync": False}


# ---------------------------------------------------------------------------------------------
# worker side (runs in spawned processes)

class FailingWriter(GdsStorageWriter):
    """Raises in write_data on one rank: a rank failing half-way through a save."""

    def __init__(self, path: Any, fail_rank: int, **options: Any) -> None:
        super().__init__(path, **options)
        self.fail_rank = fail_rank

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.rank == self.fail_rank:
            raise RuntimeError(f"injected failure on rank {self.rank}")
        return super().write_data(plan, planner)


def _state(mesh: Any, full: dict[str, Any], empty: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    def value(name: str) -> Any:
        return torch.zeros_like(full[name]) if empty else full[name].clone()

    return {
        "rep": {"w": value("rep_w"), "i": value("rep_i"), "step": 0 if empty else 17,
                "info": {"name": "" if empty else "run-α", "lrs": [] if empty else [0.1, 0.01]}},
        "sharded": {"w": distribute_tensor(value("sh_w"), mesh, [Shard(0)]),
                    "h": distribute_tensor(value("sh_h"), mesh, [Shard(0)])},
    }


def _check(state: dict[str, Any], full: dict[str, Any]) -> None:
    assert bits(state["rep"]["w"]) == bits(full["rep_w"])
    assert bits(state["rep"]["i"]) == bits(full["rep_i"])
    assert state["rep"]["step"] == 17
    assert state["rep"]["info"] == {"name": "run-α", "lrs": [0.1, 0.01]}
    for key, name in (("w", "sh_w"), ("h", "sh_h")):
        dt = state["sharded"][key]
        assert dt.dtype == full[name].dtype
        assert bits(dt.full_tensor()) == bits(full[name]), f"sharded/{key} differs"


def _worker(rank: int, world: int, root: str, tag: str, jobs: list[tuple[str, str]]) -> None:
    import faulthandler
    import traceback

    from torch.distributed.device_mesh import DeviceMesh

    faulthandler.enable(all_threads=True)  # a rank that aborts shows where (the test's stderr)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg-{tag}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        mesh = DeviceMesh("cpu", torch.arange(world))
        full = full_tensors()
        report: dict[str, Any] = {}
        row_reads: list[tuple[str, int, int]] = []
        original_get_rows = gdsckpt.Checkpoint.get_rows

        def counting_get_rows(self: Any, key: str, start: int, stop: int, device: Any = None) -> Any:
            row_reads.append((key, start, stop))
            return original_get_rows(self, key, start, stop, device)

        gdsckpt.Checkpoint.get_rows = counting_get_rows  # type: ignore[method-assign]  # this process only
        for job, where in jobs:
            path: Any = where if where.startswith("s3://") else Path(root) / where
            outcome = None
            try:
                if job == "save":
                    dcp.save(_state(mesh, full, empty=False),
                             storage_writer=GdsStorageWriter(path, **small_options()))
                elif job == "async_save":
                    future = dcp.async_save(_state(mesh, full, empty=False),
                                            storage_writer=GdsStorageWriter(path, **small_options()))
                    future.result()
                elif job == "load":
                    state = _state(mesh, full, empty=True)
                    dcp.load(state, storage_reader=GdsStorageReader(path))
                    _check(state, full)
                elif job == "fail_save":
                    dcp.save(_state(mesh, full, empty=False),
                             storage_writer=FailingWriter(path, fail_rank=1, **small_options()))
                else:  # pragma: no cover
                    raise ValueError(job)
            except BaseException as err:
                outcome = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
            report[f"{job}:{where}"] = outcome
            report[f"row_reads:{job}:{where}"] = list(row_reads)
            row_reads.clear()
            dist.barrier()
        (Path(root) / f"report-{tag}-{rank}.json").write_text(json.dumps(report))
        dist.barrier()  # every rank's report is written before any rank tears down
    finally:
        dist.destroy_process_group()


def spawn(world: int, root: Path, tag: str, jobs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Run ``jobs`` on ``world`` gloo ranks; each rank's report of what every job returned.

    A rank killed by a signal after every rank wrote its report died in torch.distributed's
    teardown (``destroy_process_group`` and exit), after all the work this test checks: seen as an
    occasional ``terminate called without an active exception`` SIGABRT in a 2-rank group on the
    CI machine. That is logged, not a failure (a warning would be one: the test configuration turns
    warnings into errors); a rank that dies earlier, or exits with an error, fails the test as
    before."""
    import logging

    import torch.multiprocessing as mp

    try:
        mp.start_processes(_worker, args=(world, str(root), tag, jobs), nprocs=world, join=True,
                           start_method="spawn")
    except mp.ProcessExitedException as err:
        written = all((root / f"report-{tag}-{r}.json").is_file() for r in range(world))
        if not (written and err.signal_name):
            raise
        logging.getLogger(__name__).warning("rank %d of group %s died with %s in torch.distributed's teardown, "
                                            "after every rank reported", err.error_index, tag, err.signal_name)
    return [json.loads((root / f"report-{tag}-{r}.json").read_text()) for r in range(world)]


# ---------------------------------------------------------------------------------------------
# multi-rank: save at N ranks, load at M != N (1 -> 4, 4 -> 2, 2 -> 1: every N and every M)

@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict[str, Any]]]]:
    """Four process groups, one after another (spawning is what costs time on a small machine):
    1 rank saves ``n1``; 4 ranks load ``n1`` and save ``n4``; 2 ranks load ``n4``, save ``n2``
    with ``async_save``, then save with rank 1 failing (over a good checkpoint, and fresh);
    1 rank loads ``n2``. Returns the root and each group's per-rank reports."""
    root = tmp_path_factory.mktemp("dcp")
    reports = {
        "g1": spawn(1, root, "g1", [("save", "n1")]),
        "g4": spawn(4, root, "g4", [("load", "n1"), ("save", "n4")]),
        "g2": spawn(2, root, "g2", [("load", "n4"), ("async_save", "n2"), ("save", "failed"),
                                    ("fail_save", "failed"), ("load", "failed"), ("fail_save", "fresh")]),
        "g1b": spawn(1, root, "g1b", [("load", "n2")]),
    }
    return root, reports


def _outcomes(reports: list[dict[str, Any]], entry: str) -> list[Any]:
    return [report[entry] for report in reports]


@pytest.mark.parametrize("group, entry", [
    ("g1", "save:n1"), ("g4", "save:n4"), ("g2", "async_save:n2"),  # save at N ranks
    ("g4", "load:n1"), ("g2", "load:n4"), ("g1b", "load:n2"),  # load at M != N ranks, bit-exact (_check)
])
def test_save_at_n_ranks_and_load_at_m_ranks(chain: Any, group: str, entry: str) -> None:
    _root, reports = chain
    for outcome in _outcomes(reports[group], entry):
        assert outcome is None, outcome


def test_resharded_ranks_read_only_their_rows(chain: Any) -> None:
    # Four ranks loading what one rank saved: each needs its Shard(0) rows of every sharded item
    # and reads just those (Checkpoint.get_rows: only the chunks holding them).
    _root, reports = chain
    for rank, report in enumerate(reports["g4"]):
        expected = {}
        for key, name in (("sharded.w", "sh_w"), ("sharded.h", "sh_h")):
            rows = SHAPES[name][0][0]
            size = -(-rows // 4)  # torch.chunk's split, as DTensor Shard(0) places rows
            first, last = min(rank * size, rows), min((rank + 1) * size, rows)
            if last > first:
                expected[key] = (first, last)
        got = {key.split("@")[0]: (start, stop) for key, start, stop in report["row_reads:load:n1"]}
        assert got == expected, (rank, report["row_reads:load:n1"])
    # one rank loading what two saved needs every row of each stored shard: whole reads only
    assert reports["g1b"][0]["row_reads:load:n2"] == []


def test_layout_of_a_multi_rank_checkpoint(chain: Any) -> None:
    root, _reports = chain
    names = sorted(os.listdir(root / "n4"))
    files = rank_files(root / "n4")
    assert names == sorted([".metadata", ".metadata.json", *files.values()]) and sorted(files) == [0, 1, 2, 3]
    with open(root / "n4" / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    # the JSON form the reader uses holds the same sharded metadata as the pickle
    from_json = GdsStorageReader(root / "n4").read_metadata()
    from_json.storage_meta.load_id = None
    assert from_json == metadata
    infos = metadata.storage_data
    assert infos and all(isinstance(info, GdsStorageInfo) for info in infos.values())
    # each DTensor shard lives in its own rank's file, under the key of its MetadataIndex
    shards = sorted((index.offset[0], info.relative_path) for index, info in infos.items()
                    if index.fqn == "sharded.w")
    assert shards == [(0, files[0]), (3, files[1]), (6, files[2]), (9, files[3])]
    for index, info in infos.items():
        assert info.key == item_key(index)
        with gdsckpt.open(root / "n4" / info.relative_path) as ckpt:
            assert info.key in ckpt
    for name in names[2:]:
        gdsckpt.verify(root / "n4" / name)


def test_failing_rank_raises_everywhere_and_keeps_the_previous_checkpoint(chain: Any) -> None:
    root, reports = chain
    assert _outcomes(reports["g2"], "save:failed") == [None, None]
    for where in ("failed", "fresh"):
        for rank, outcome in enumerate(_outcomes(reports["g2"], f"fail_save:{where}")):
            assert outcome is not None, f"rank {rank} did not see the failure ({where})"
            assert outcome.startswith("CheckpointException"), outcome
            assert "injected failure on rank 1" in outcome, outcome
    # "failed" held a good checkpoint: the failed save over it left it loadable, bit-exact, on
    # every rank (its rank files untouched beside the failed save's rank-0 file)
    assert _outcomes(reports["g2"], "load:failed") == [None, None]
    assert (root / "failed" / ".metadata").exists() and (root / "failed" / ".metadata.json").exists()
    assert len([name for name in os.listdir(root / "failed") if RANK_FILE.fullmatch(name)]) == 3
    # "fresh" held nothing: still no checkpoint
    assert not (root / "fresh" / ".metadata").exists() and not (root / "fresh" / ".metadata.json").exists()
    with pytest.raises(CheckpointException), pytest.warns(UserWarning, match=DISABLED):
        dcp.load({"rep": {"w": torch.zeros(6, 5)}}, storage_reader=GdsStorageReader(root / "fresh"))


# ---------------------------------------------------------------------------------------------
# single process, no process group

def plain_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {"model": {"w": torch.randn(64, 33, generator=g), "b": torch.zeros(33, dtype=torch.bfloat16),
                      "t": torch.arange(100).reshape(10, 10).t()},  # a non-contiguous view
            "step": 5, "blob": {"note": "ok", "vals": (1, 2.5)}}


def empty_like(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "step": 0, "blob": {"note": "", "vals": ()}}


def test_single_process_round_trip(tmp_path: Path) -> None:
    state = plain_state()
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.save(state, storage_writer=GdsStorageWriter(tmp_path, codec="zstd", **small_options()))
    assert sorted(os.listdir(tmp_path)) == [".metadata", ".metadata.json", rank_files(tmp_path)[0]]
    target = empty_like(state)
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.load(target, storage_reader=GdsStorageReader(tmp_path))
    for key, value in state["model"].items():
        assert bits(target["model"][key]) == bits(value), key
    assert target["step"] == 5
    assert target["blob"] == {"note": "ok", "vals": (1, 2.5)}


def test_fqns_with_slash_and_tilde_round_trip(tmp_path: Path) -> None:
    # Such FQNs are escaped once, by gdsckpt.save; the key in storage_data is that escaped key.
    state = {"a/b": torch.arange(6.0), "c~d": {"e/f~": torch.ones(3, dtype=torch.bfloat16)}, "n/x": 4}
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.save(state, storage_writer=GdsStorageWriter(tmp_path, codec="zstd", **small_options()))
    target = {"a/b": torch.zeros(6), "c~d": {"e/f~": torch.zeros(3, dtype=torch.bfloat16)}, "n/x": 0}
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.load(target, storage_reader=GdsStorageReader(tmp_path))
    assert bits(target["a/b"]) == bits(state["a/b"]) and bits(target["c~d"]["e/f~"]) == bits(state["c~d"]["e/f~"])
    assert target["n/x"] == 4
    with gdsckpt.open(tmp_path / rank_files(tmp_path)[0]) as ckpt:
        assert "a~1b@0" in list(ckpt.keys())


def test_rank_file_is_a_plain_gdsckpt_file(tmp_path: Path) -> None:
    state = plain_state()
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.save(state, storage_writer=GdsStorageWriter(tmp_path, codec="zstd", **small_options()))
    info = gdsckpt.inspect(tmp_path / rank_files(tmp_path)[0])
    assert set(info.codecs) and all("zstd" in label or label == "none/1" for label in info.codecs)
    with gdsckpt.open(tmp_path / rank_files(tmp_path)[0]) as ckpt:
        assert bits(ckpt.get("model.w@0,0")) == bits(state["model"]["w"])
        assert bits(ckpt.get("model.t@0,0")) == bits(state["model"]["t"])
        # DCP's byte items are stored as raw uint8 tensors holding DCP's own serialisation
        step = ckpt.get("step@")
        assert step.dtype == torch.uint8 and step.dim() == 1
        assert torch.load(io.BytesIO(step.numpy().tobytes()), weights_only=False) == 5


def test_checkpoint_id_overrides_path_and_overwrite(tmp_path: Path) -> None:
    first, second = plain_state(), plain_state()
    second["model"]["w"] += 1
    second["step"] = 6
    writer = GdsStorageWriter(tmp_path / "unused", **small_options())
    for state in (first, second):
        with pytest.warns(UserWarning, match=DISABLED):
            dcp.save(state, checkpoint_id=tmp_path / "ck", storage_writer=writer)
    assert not (tmp_path / "unused").exists()
    target = empty_like(first)
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.load(target, checkpoint_id=tmp_path / "ck", storage_reader=GdsStorageReader(tmp_path / "unused"))
    assert bits(target["model"]["w"]) == bits(second["model"]["w"])
    assert target["step"] == 6
    assert [p.name for p in (tmp_path / "ck").iterdir() if p.name.endswith(".tmp")] == []


def test_async_save_single_process(tmp_path: Path) -> None:
    state = plain_state()
    with pytest.warns(UserWarning, match=DISABLED):
        future = dcp.async_save(state, storage_writer=GdsStorageWriter(tmp_path, **small_options()))
        future.result()
    target = empty_like(state)
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.load(target, storage_reader=GdsStorageReader(tmp_path))
    assert bits(target["model"]["w"]) == bits(state["model"]["w"])


def test_reader_rejects_a_filesystemwriter_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                       h: Any) -> None:
    state = plain_state()
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, sync_files=False))
    # its .metadata is a pickle only: read only when trusted, and then its storage data is foreign
    with h.dcp_load_fails_saying(caplog, "trust_pickle=True"), pytest.warns(UserWarning, match=DISABLED):
        dcp.load(empty_like(state), storage_reader=GdsStorageReader(tmp_path))
    with pytest.raises(CheckpointException, match="not written by GdsStorageWriter"), \
            pytest.warns(UserWarning, match=DISABLED):
        dcp.load(empty_like(state), storage_reader=GdsStorageReader(tmp_path, trust_pickle=True))


def test_missing_metadata_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.save(plain_state(), storage_writer=GdsStorageWriter(tmp_path, **small_options()))
    (tmp_path / ".metadata").unlink()
    with pytest.raises(CheckpointException), pytest.warns(UserWarning, match=DISABLED):
        dcp.load(empty_like(plain_state()), storage_reader=GdsStorageReader(tmp_path))


def test_item_key_encodes_fqn_and_offsets() -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    assert item_key(MetadataIndex("a.b", torch.Size([3, 0]))) == "a.b@3,0"
    assert item_key(MetadataIndex("step")) == "step@"
    assert item_key(MetadataIndex("odd/name~x", torch.Size([1]))) == "odd~1name~0x@1"


def test_load_reads_only_the_needed_items(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    state = plain_state()
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.save(state, storage_writer=GdsStorageWriter(tmp_path, **small_options()))
    fetched: list[str] = []
    original = gdsckpt.Checkpoint.get_many

    def spy(self: Any, keys: Any, device: Any = None) -> Any:
        keys = list(keys)
        fetched.extend(keys)
        return original(self, keys, device)

    fill = gdsckpt.Checkpoint._fill

    def spy_fill(self: Any, targets: dict[str, Any]) -> None:
        fetched.extend(targets)
        fill(self, targets)

    monkeypatch.setattr(gdsckpt.Checkpoint, "get_many", spy)
    monkeypatch.setattr(gdsckpt.Checkpoint, "_fill", spy_fill)
    target = {"model": {"w": torch.zeros(64, 33)}}
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.load(target, storage_reader=GdsStorageReader(tmp_path),
                 planner=DefaultLoadPlanner(allow_partial_load=True))
    assert fetched == ["model.w@0,0"]
    assert bits(target["model"]["w"]) == bits(state["model"]["w"])


def test_rank_local_metadata_without_collectives(tmp_path: Path) -> None:
    state = plain_state()
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.save(state, storage_writer=GdsStorageWriter(tmp_path, **small_options()), use_collectives=False)
    assert sorted(os.listdir(tmp_path)) == ["__0.metadata", "__0.metadata.json", rank_files(tmp_path)[0]]
    target = empty_like(state)
    with pytest.warns(UserWarning, match=DISABLED):  # DCP falls back to __<rank>.metadata
        dcp.load(target, storage_reader=GdsStorageReader(tmp_path))
    assert bits(target["model"]["w"]) == bits(state["model"]["w"])
    assert target["step"] == 5


def test_a_load_of_many_tensors_describes_the_rank_file_once(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader asks ``Checkpoint.info`` about every key (about three times each), and each call
    described every array of the file again: quadratic (2,000 tensors loaded in 23 s on 2 cores,
    20,000 not within 300 s, against 0.46 s for torch's reader)."""
    from gdsckpt.api import checkpoint as checkpoint_module

    calls = []
    original = checkpoint_module.tensor_infos
    monkeypatch.setattr(checkpoint_module, "tensor_infos", lambda index: calls.append(1) or original(index))
    state = {"model": {f"p{i}": torch.full((3,), float(i)) for i in range(300)}}
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.save(state, storage_writer=GdsStorageWriter(tmp_path, **small_options()))
    target = {"model": {key: torch.zeros(3) for key in state["model"]}}
    calls.clear()
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.load(target, storage_reader=GdsStorageReader(tmp_path))
    assert all(torch.equal(target["model"][key], value) for key, value in state["model"].items())
    assert len(calls) <= 1, len(calls)
