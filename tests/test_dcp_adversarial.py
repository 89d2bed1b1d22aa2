"""gdsckpt.dcp under an adversarial pass: each test failed before its fix.

- one changed byte in ``.metadata.json`` delivered a wrong tensor without an error;
- two saves to one directory at once left one's metadata beside the other's rank file, and a load
  returned a mix;
- after a failed collective save, stale ``__<rank>.metadata`` files of an earlier save without
  collectives made ``dcp.load`` fall back to them and return a mix;
- a writer option or a state item that fails only inside ``write_data`` (after the coordinator
  removed the previous ``.metadata``) left the previous, complete checkpoint unloadable; so did
  any save that failed over it (each save's rank files now have names of their own, and nothing
  of the previous checkpoint is removed before the new metadata is written);
- one writer reused for two overlapping ``dcp.async_save`` calls wrote both into the second
  directory, both futures reporting success;
- ``gs://``, ``S3://`` and ``file://`` locations were written to a relative local directory.

Multi-rank cases run on gloo process groups spawned as ``tests/test_dcp.py`` does. In this process
(no process group) DCP warns "torch.distributed is disabled": the tests expect it.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
dcp = pytest.importorskip("torch.distributed.checkpoint")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover - depends on the build
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import gdsckpt
from gdsckpt.dcp import GdsStorageReader, GdsStorageWriter
from gdsckpt.errors import CodecUnavailableError, CorruptCheckpointError

DISABLED = r"torch\.distributed is disabled"
OPTIONS = {"chunk_bytes": 4096, "pack_below": 256, "codec_threads": 1, "io_threads": 2, "fsync": False}


def bits(tensor: Any) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def rank_file(directory: Path, rank: int = 0) -> Path:
    """The one rank file of ``rank`` in ``directory`` (its name carries the save's file id)."""
    (found,) = directory.glob(f"__{rank}_*.gdsckpt")
    return found


def save(state: dict[str, Any], path: Path | str, **options: Any) -> None:
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.save(state, storage_writer=GdsStorageWriter(path, **{**OPTIONS, **options}))


def load(target: dict[str, Any], path: Path) -> None:
    with pytest.warns(UserWarning, match=DISABLED):
        dcp.load(target, storage_reader=GdsStorageReader(path))


def three_tensors() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(4, 4, generator=g), "c": torch.randn(4, 4, generator=g),
            "i": torch.arange(16).reshape(4, 4) * 3}


# ---------------------------------------------------------------------------------------------
# 1. .metadata.json: a digest of its own content, and chunks, keys and stored arrays that agree

ONE_BYTE_EDITS = {
    "chunk_rows": ('"sizes":[4,4]', '"sizes":[3,4]'),  # a row of 'a' left stale
    "chunk_columns": ('"sizes":[4,4]', '"sizes":[4,2]'),
    "key_of_another_tensor": ('"key":"a@0,0"', '"key":"c@0,0"'),  # c's data delivered into a
    "key_of_another_dtype": ('"key":"a@0,0"', '"key":"i@0,0"'),  # int64 data cast into float32
    "dtype": ('"dtype":"float32"', '"dtype":"float16"'),
}


@pytest.mark.parametrize("case", sorted(ONE_BYTE_EDITS))
def test_one_changed_byte_of_metadata_json_is_refused(tmp_path: Path, case: str) -> None:
    save(three_tensors(), tmp_path)
    text = (tmp_path / ".metadata.json").read_text()
    old, new = ONE_BYTE_EDITS[case]
    assert old in text and len(old) == len(new)
    (tmp_path / ".metadata.json").write_text(text.replace(old, new, 1))
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata\.json.*does not match its digest"):
        GdsStorageReader(tmp_path).read_metadata()


def _without_digest(path: Path, old: str, new: str) -> None:
    """Edit ``.metadata.json`` as a document written before the digest existed (none to check)."""
    doc = json.loads((path / ".metadata.json").read_text())
    del doc["digest"]
    text = json.dumps(doc, separators=(",", ":"))
    assert old in text
    (path / ".metadata.json").write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("old, new, message", [
    ('"sizes":[4,4]', '"sizes":[3,4]', r"chunks of 'a' hold 12 elements; the tensor of size \[4, 4\] has 16"),
    ('"key":"a@0,0"', '"key":"c@0,0"', r"storage entry 'a'.* names key 'c@0,0'; that item's key is 'a@0,0'"),
], ids=["chunks_leave_a_row", "key_of_another_tensor"])
def test_inconsistent_metadata_is_refused_without_a_digest(tmp_path: Path, old: str, new: str,
                                                            message: str) -> None:
    save(three_tensors(), tmp_path)
    _without_digest(tmp_path, old, new)
    with pytest.raises(CorruptCheckpointError, match=message):
        GdsStorageReader(tmp_path).read_metadata()


def test_stored_array_of_another_dtype_is_refused(tmp_path: Path) -> None:
    # The rank file holds an int32 array where the metadata says float32, same shape and file id:
    # copy_ would cast its values into the float target.
    state = three_tensors()
    save(state, tmp_path)
    path = rank_file(tmp_path)
    flat = gdsckpt.load(path)
    flat["a@0,0"] = flat["a@0,0"].view(torch.int32)
    gdsckpt.save(flat, path)
    with pytest.raises(CheckpointException, match=r"holds 'a@0,0' as int32 \[4, 4\]; its DCP metadata says "
                                                  r"float32 \[4, 4\]"), pytest.warns(UserWarning, match=DISABLED):
        dcp.load({name: torch.zeros_like(value) for name, value in state.items()},
                 storage_reader=GdsStorageReader(tmp_path))


def test_overlapping_chunks_are_refused(tmp_path: Path) -> None:
    # two row shards of one tensor that overlap by a row and leave the last one uncovered: as many
    # elements as the tensor, yet not a tiling
    save({"w": torch.arange(8.0).reshape(4, 2)}, tmp_path)
    metadata = GdsStorageReader(tmp_path).read_metadata()
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from gdsckpt.integrations.dcp_metadata import check_metadata

    md = metadata.state_dict_metadata["w"]
    md.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])),
                 ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([2, 2]))]
    metadata.storage_data = {}
    with pytest.raises(CorruptCheckpointError, match=r"chunks of 'w' overlap"):
        check_metadata(metadata, "test")


# ---------------------------------------------------------------------------------------------
# 2. a rank file of another save than the metadata's is refused, naming it

def test_concurrent_saves_to_one_directory_are_not_loaded_as_a_mix(tmp_path: Path) -> None:
    # Job A's metadata is written last (a slow finish), after job B saved whole: B's finish
    # removed A's rank file, which A's metadata names. Job B saves inside A's finish, so the
    # interleaving is exact.
    class SlowFinish(GdsStorageWriter):
        def finish(self, metadata: Any, results: Any) -> None:
            dcp.save({"w": torch.arange(24.0).reshape(8, 3) + 1000},
                     storage_writer=GdsStorageWriter(tmp_path, **OPTIONS))
            super().finish(metadata, results)

    with pytest.warns(UserWarning, match=DISABLED):
        dcp.save({"w": torch.arange(12.0).reshape(4, 3)}, storage_writer=SlowFinish(tmp_path, **OPTIONS))
    target = {"w": torch.full((4, 3), -1.0)}
    with pytest.raises(CheckpointException, match=r"CorruptCheckpointError: __0_[0-9a-f]+\.gdsckpt, which the "
                                                  r"DCP metadata of .* names, is missing: another save"), \
            pytest.warns(UserWarning, match=DISABLED):
        dcp.load(target, storage_reader=GdsStorageReader(tmp_path))
    assert bits(target["w"]) == bits(torch.full((4, 3), -1.0))


def test_a_rank_file_of_another_save_is_refused(tmp_path: Path) -> None:
    # A rank file replaced by another save's under the same name (copied over it by hand, or by a
    # tool that renames): its file id is not the metadata's.
    save({"w": torch.arange(12.0).reshape(4, 3)}, tmp_path / "a")
    save({"w": torch.arange(12.0).reshape(4, 3) + 1000}, tmp_path / "b")
    os.replace(rank_file(tmp_path / "b"), rank_file(tmp_path / "a"))
    target = {"w": torch.full((4, 3), -1.0)}
    with pytest.raises(CheckpointException, match=r"CorruptCheckpointError: __0_[0-9a-f]+\.gdsckpt in .* was "
                                                  r"written by another save"), \
            pytest.warns(UserWarning, match=DISABLED):
        dcp.load(target, storage_reader=GdsStorageReader(tmp_path / "a"))
    assert bits(target["w"]) == bits(torch.full((4, 3), -1.0))


# ---------------------------------------------------------------------------------------------
# 3 (and 2 at two ranks). gloo process groups: stale rank-local metadata, saves without collectives

class FailOnRank1(GdsStorageWriter):
    """Raises in write_data on rank 1, after rank 0 wrote its file."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.rank == 1:
            time.sleep(0.5)
            raise RuntimeError("injected failure on rank 1")
        return super().write_data(plan, planner)


def _sharded(mesh: Any, value: float) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {"w": distribute_tensor(torch.full((4, 3), value), mesh, [Shard(0)]), "step": int(value)}


def _worker(rank: int, world: int, root: str) -> None:
    import traceback

    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    report: dict[str, Any] = {}
    try:
        mesh = DeviceMesh("cpu", torch.arange(world))

        def step(name: str, job: Any) -> None:
            """Run ``job`` on every rank; report what it returned or raised."""
            try:
                report[name] = job()
            except BaseException as err:
                report[name] = f"raised {type(err).__name__}: {err}\n{traceback.format_exc()}"
            dist.barrier()

        ck = f"{root}/ck"

        def saved(value: float, writer: type[GdsStorageWriter] = GdsStorageWriter, **kwargs: Any) -> None:
            dcp.save(_sharded(mesh, value), storage_writer=writer(ck, **OPTIONS), **kwargs)

        def loaded() -> Any:
            target = _sharded(mesh, -1)
            dcp.load(target, storage_reader=GdsStorageReader(ck))
            return [target["w"].full_tensor()[:, 0].tolist(), target["step"]]

        # without collectives: each rank writes __<rank>.metadata, which dcp.load falls back to
        step("s1", lambda: saved(1, use_collectives=False))
        step("s1_listing", lambda: sorted(os.listdir(ck)))
        step("s1_load", loaded)
        # a collective save over it, then one that fails on rank 1 after rank 0 wrote its file
        step("s2", lambda: saved(2))
        step("s2_listing", lambda: sorted(os.listdir(ck)))
        step("s3", lambda: saved(3, FailOnRank1))
        step("s3_listing", lambda: sorted(os.listdir(ck)))
        step("s3_load", loaded)
        step("s4", lambda: saved(4))
        step("s4_listing", lambda: sorted(os.listdir(ck)))
        step("s4_load", loaded)
    finally:
        (Path(root) / f"report-{rank}.json").write_text(json.dumps(report))
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's report of ``_worker``'s steps (one spawn: starting ranks is what costs time)."""
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("dcp_adversarial")
    try:
        mp.start_processes(_worker, args=(2, str(root)), nprocs=2, join=True, start_method="spawn")
    except mp.ProcessExitedException as err:
        # a rank killed by a signal in torch.distributed's teardown, after both reported (as in
        # tests/test_dcp.py); any other failure fails the tests
        if not (err.signal_name and all((root / f"report-{r}.json").is_file() for r in range(2))):
            raise
    return [json.loads((root / f"report-{r}.json").read_text()) for r in range(2)]


def _shape(listing: list[str]) -> list[str]:
    """A listing with each rank file's id replaced by ``<id>``."""
    return sorted(re.sub(r"^(__[0-9]+_)[0-9a-f]{32}(\.gdsckpt)$", r"\1<id>\2", name) for name in listing)


def test_saves_without_collectives_still_work(two_ranks: list[dict[str, Any]]) -> None:
    for report in two_ranks:
        assert report["s1"] is None, report["s1"]
        assert _shape(report["s1_listing"]) == ["__0.metadata", "__0.metadata.json", "__0_<id>.gdsckpt",
                                                "__1.metadata", "__1.metadata.json", "__1_<id>.gdsckpt"]
        assert report["s1_load"] == [[1.0, 1.0, 1.0, 1.0], 1], report["s1_load"]


def test_collective_save_removes_stale_rank_metadata(two_ranks: list[dict[str, Any]]) -> None:
    for report in two_ranks:
        assert report["s2"] is None, report["s2"]
        # the collective save's finish removed the rank-local metadata and the rank files of s1
        assert _shape(report["s2_listing"]) == [".metadata", ".metadata.json", "__0_<id>.gdsckpt",
                                                "__1_<id>.gdsckpt"]
        assert str(report["s3"]).startswith("raised CheckpointException"), report["s3"]
        # the failed save left s2 as it was, beside the rank file rank 0 wrote before rank 1 failed
        assert set(report["s2_listing"]) < set(report["s3_listing"])
        assert _shape(report["s3_listing"]) == [".metadata", ".metadata.json", "__0_<id>.gdsckpt",
                                                "__0_<id>.gdsckpt", "__1_<id>.gdsckpt"]
        assert report["s3_load"] == [[2.0, 2.0, 2.0, 2.0], 2], report["s3_load"]
        # the next save removed s2's files and the failed save's
        assert report["s4"] is None, report["s4"]
        assert _shape(report["s4_listing"]) == [".metadata", ".metadata.json", "__0_<id>.gdsckpt",
                                                "__1_<id>.gdsckpt"]
        assert not set(report["s4_listing"]) & (set(report["s3_listing"]) - {".metadata", ".metadata.json"})
        assert report["s4_load"] == [[4.0, 4.0, 4.0, 4.0], 4], report["s4_load"]


# ---------------------------------------------------------------------------------------------
# 4. what would fail inside write_data is refused before the previous checkpoint's metadata goes

@pytest.mark.parametrize("options, error, message", [
    ({"codec": "zstd/9"}, ValueError, r"unknown codec 'zstd/9'"),
    ({"codec": "nvcomp.ans"}, ValueError, r"unknown codec 'nvcomp\.ans'"),
    ({"codec": "zstd", "level": 30}, ValueError, r"level=30 is not a valid zstd compression level"),
    ({"level": 30}, ValueError, r"level=30 is not a valid zstd"),  # "auto" compresses with zstd on the CPU
    ({"codec": "ans", "engine": "cpu"}, CodecUnavailableError, r"codec 'ans' runs only on the GPU engine"),
], ids=["versioned_name", "nvcomp_name", "zstd_level", "auto_level", "gpu_codec_on_cpu_engine"])
def test_bad_writer_options_are_refused_at_construction(tmp_path: Path, options: dict[str, Any],
                                                         error: type[Exception], message: str) -> None:
    save({"w": torch.arange(10.0)}, tmp_path)
    with pytest.raises(error, match=message):
        GdsStorageWriter(tmp_path, **{**OPTIONS, **options})
    target = {"w": torch.zeros(10)}
    load(target, tmp_path)  # the previous checkpoint is untouched
    assert bits(target["w"]) == bits(torch.arange(10.0))


def test_gpu_codec_without_a_gpu_is_refused_at_construction(tmp_path: Path) -> None:
    from gdsckpt.codecs.nvcomp import gpu_available

    if gpu_available():
        pytest.skip("a GPU engine is usable here")
    with pytest.raises(CodecUnavailableError, match=r"codec 'ans' runs only on the GPU engine .*not usable here"):
        GdsStorageWriter(tmp_path, codec="ans")


def test_sparse_tensor_is_refused_before_any_rank_writes(tmp_path: Path) -> None:
    save({"w": torch.arange(10.0)}, tmp_path)
    state = {"w": torch.arange(10.0) + 1, "s": torch.eye(3).to_sparse()}
    with pytest.raises(CheckpointException, match=r"tensor 's' has layout torch\.sparse_coo.*to_dense"), \
            pytest.warns(UserWarning, match=DISABLED):
        dcp.save(state, storage_writer=GdsStorageWriter(tmp_path, **OPTIONS))
    target = {"w": torch.zeros(10)}
    load(target, tmp_path)
    assert bits(target["w"]) == bits(torch.arange(10.0))


def test_a_meta_tensor_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    # The plan does not show the device: this fails inside write_data, once the ranks write.
    save({"w": torch.arange(10.0)}, tmp_path)
    state = {"w": torch.arange(10.0) + 1, "m": torch.empty(3, device="meta")}
    with pytest.raises(CheckpointException), pytest.warns(UserWarning, match=DISABLED):
        dcp.save(state, storage_writer=GdsStorageWriter(tmp_path, **OPTIONS))
    target = {"w": torch.zeros(10)}
    load(target, tmp_path)
    assert bits(target["w"]) == bits(torch.arange(10.0))


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from gdsckpt.integrations import dcp as dcp_module

    save({"w": torch.arange(10.0)}, tmp_path)
    before = sorted(os.listdir(tmp_path))

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(dcp_module.api, "save", full_disk)
    with pytest.raises(CheckpointException, match="No space left"), pytest.warns(UserWarning, match=DISABLED):
        dcp.save({"w": torch.arange(10.0) + 1}, storage_writer=GdsStorageWriter(tmp_path, **OPTIONS))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == before
    target = {"w": torch.zeros(10)}
    load(target, tmp_path)
    assert bits(target["w"]) == bits(torch.arange(10.0))


@pytest.mark.parametrize("pickle_only", [False, True], ids=["json_and_pickle", "pickle_only"])
def test_a_save_failing_to_write_metadata_keeps_the_previous_checkpoint(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       pickle_only: bool) -> None:
    # .metadata.json is replaced (or, for metadata without a JSON form, removed) before .metadata
    # is written: when that write fails, the previous JSON comes back, which describes the
    # previous .metadata, still in place.
    import errno

    from gdsckpt.integrations import dcp as dcp_module

    save({"w": torch.arange(10.0)}, tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in (".metadata", ".metadata.json")}
    original = dcp_module._Files.write

    def failing(self: Any, name: str, data: bytes, fsync: bool) -> None:
        if name == ".metadata":
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        original(self, name, data, fsync)

    def unexpressible(*args: Any, **kwargs: Any) -> Any:
        raise dcp_module.UnexpressibleMetadata("planner_data (injected)")

    monkeypatch.setattr(dcp_module._Files, "write", failing)
    if pickle_only:
        monkeypatch.setattr(dcp_module, "encode_metadata_json", unexpressible)
    with pytest.raises(CheckpointException, match="No space left"), pytest.warns(UserWarning):
        dcp.save({"w": torch.arange(10.0) + 1}, storage_writer=GdsStorageWriter(tmp_path, **OPTIONS))
    monkeypatch.undo()
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    target = {"w": torch.zeros(10)}
    load(target, tmp_path)  # the default reader: the JSON path
    assert bits(target["w"]) == bits(torch.arange(10.0))


def test_a_save_without_collectives_over_a_collective_checkpoint_loads(tmp_path: Path) -> None:
    # dcp.load reads .metadata before any rank-local __<rank>.metadata: the collective
    # checkpoint's, which names the rank files this save replaced, goes once the save is written.
    # The writer warns that it will retire the collective checkpoint (a rank whose save failed
    # could not load it any more).
    save({"w": torch.arange(10.0)}, tmp_path)
    with pytest.warns(UserWarning) as caught:
        dcp.save({"w": torch.arange(10.0) + 1}, storage_writer=GdsStorageWriter(tmp_path, **OPTIONS),
                 use_collectives=False)
    said = [str(warning.message) for warning in caught]
    assert any("holds a collective checkpoint" in text for text in said), said
    assert not (tmp_path / ".metadata").exists() and not (tmp_path / ".metadata.json").exists()
    target = {"w": torch.zeros(10)}
    load(target, tmp_path)
    assert bits(target["w"]) == bits(torch.arange(10.0) + 1)


# ---------------------------------------------------------------------------------------------
# 5. one writer, two overlapping async saves

class HeldWriter(GdsStorageWriter):
    """Holds each save in write_data until ``release`` is set; ``entered`` counts the saves there."""

    def __init__(self, path: Any, **options: Any) -> None:
        super().__init__(path, **options)
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.entered.release()
        assert self.release.wait(30), "the test never released the save"
        return super().write_data(plan, planner)


def test_a_reused_writer_runs_overlapping_async_saves_each_to_its_own_checkpoint(tmp_path: Path) -> None:
    writer = HeldWriter(tmp_path / "unused", **OPTIONS)
    with pytest.warns(UserWarning, match=DISABLED):
        first = dcp.async_save({"w": torch.ones(3)}, storage_writer=writer, checkpoint_id=tmp_path / "step1")
        assert writer.entered.acquire(timeout=30)  # the first save is writing
        second = dcp.async_save({"w": torch.ones(3) * 2}, storage_writer=writer, checkpoint_id=tmp_path / "step2")
        assert writer.entered.acquire(timeout=30)  # and the second, set up while the first runs
        writer.release.set()
        first.result(timeout=60)
        second.result(timeout=60)
    for step, value in (("step1", 1), ("step2", 2)):
        target = {"w": torch.zeros(3)}
        load(target, tmp_path / step)
        assert bits(target["w"]) == bits(torch.ones(3) * value)
    assert not (tmp_path / "unused").exists()


class FailingPlanner(DefaultSavePlanner):
    """Fails the save before the writer's ``write_data``: DCP tells the writer nothing of it."""

    def create_local_plan(self) -> Any:
        raise RuntimeError("injected planner failure")


def test_a_save_that_failed_before_writing_does_not_hold_the_writer(tmp_path: Path) -> None:
    """A save that failed before ``write_data`` (a planner's error; on the coordinator, another
    rank's failure) on a thread that lives on: the writer took it for a save still in flight and
    refused every later save from another thread (``RuntimeError: still saving``)."""
    writer = GdsStorageWriter(tmp_path / "unused", **OPTIONS)
    both_busy = threading.Barrier(2)  # the two saves run on two different live threads

    def failing() -> None:
        both_busy.wait(30)
        with pytest.warns(UserWarning, match=DISABLED), pytest.raises(CheckpointException, match="injected"):
            dcp.save({"w": torch.ones(3)}, storage_writer=writer, checkpoint_id=tmp_path / "failed",
                     planner=FailingPlanner())

    with ThreadPoolExecutor(max_workers=2) as pool:
        failed = pool.submit(failing)

        def later() -> None:
            both_busy.wait(30)
            failed.result(timeout=60)
            with pytest.warns(UserWarning, match=DISABLED):
                dcp.save({"w": torch.ones(3) * 5}, storage_writer=writer, checkpoint_id=tmp_path / "later")

        pool.submit(later).result(timeout=120)
    target = {"w": torch.zeros(3)}
    load(target, tmp_path / "later")
    assert bits(target["w"]) == bits(torch.ones(3) * 5)
    assert not (tmp_path / "failed" / ".metadata").exists()


def test_torchs_own_reader_on_a_gdsckpt_checkpoint_names_the_reader_to_use(tmp_path: Path) -> None:
    """``dcp.load(state, checkpoint_id=dir)`` picks torch's ``FileSystemReader``, which failed on
    gdsckpt's rank files with ``AttributeError: 'GdsStorageInfo' object has no attribute 'offset'``."""
    save({"w": torch.arange(6.0)}, tmp_path)
    with pytest.warns(UserWarning, match=DISABLED), \
            pytest.raises(CheckpointException, match=r"GdsStorageWriter.*GdsStorageReader"):
        dcp.load({"w": torch.zeros(6)}, checkpoint_id=tmp_path)
    target = {"w": torch.zeros(6)}
    load(target, tmp_path)  # the checkpoint itself is fine
    assert bits(target["w"]) == bits(torch.arange(6.0))


# ---------------------------------------------------------------------------------------------
# 6. URLs of other schemes

@pytest.mark.parametrize("url", ["gs://bucket/run", "S3://bucket/run", "file:///tmp/run", "s3a://bucket/run"])
def test_foreign_url_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.chdir(tmp_path)
    for make in (GdsStorageWriter, GdsStorageReader):
        with pytest.raises(ValueError, match=r"scheme gdsckpt does not store to.*s3://bucket/prefix"):
            make(url)
    with pytest.raises(ValueError, match=r"s3://"):
        GdsStorageWriter(tmp_path / "ok", **OPTIONS).reset(url)
    assert os.listdir(tmp_path) == []
    GdsStorageWriter("s3://bucket/run")  # the supported scheme (nothing is written until a save)


# ---------------------------------------------------------------------------------------------
# 7. a target of another dtype: DCP's semantics, as torch's FileSystemReader (documented)

def test_target_of_another_dtype_is_cast_as_filesystemreader_does(tmp_path: Path) -> None:
    state = {"i": torch.tensor([2 ** 40 + 1, -3]), "x": torch.tensor([1.0001, 3.14159265])}
    targets = []
    for writer, reader, where in ((GdsStorageWriter, GdsStorageReader, tmp_path / "gds"),
                                  (dcp.FileSystemWriter, dcp.FileSystemReader, tmp_path / "fs")):
        target = {"i": torch.zeros(2, dtype=torch.int32), "x": torch.zeros(2, dtype=torch.bfloat16)}
        with pytest.warns(UserWarning, match=DISABLED):
            dcp.save(state, storage_writer=writer(where))
            dcp.load(target, storage_reader=reader(where))
        targets.append(target)
    assert all(bits(targets[0][k]) == bits(targets[1][k]) for k in state)


def test_an_unknown_writer_option_names_the_writer_and_what_it_takes(tmp_path: Path) -> None:
    """Options of torch's FileSystemWriter, or ``lossy=``, failed inside ``Config.__init__``."""
    for options in ({"sync_files": False}, {"lossy": "bf16"}, {"thread_count": 4}):
        with pytest.raises(TypeError, match=r"GdsStorageWriter got unknown option.*fields of gdsckpt\.Config"):
            GdsStorageWriter(tmp_path, **options)
    assert os.listdir(tmp_path) == []


def test_the_next_save_removes_a_killed_ranks_temporary(tmp_path: Path) -> None:
    """Each save writes rank files of new names, so a killed rank's temporary was never removed
    by gdsckpt.save's sweep of its own target and stayed for good, one more per killed save."""
    import subprocess
    import sys

    save({"w": torch.arange(4.0)}, tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        left = tmp_path / f".__0_{'a' * 32}.gdsckpt.gdsckpt-tmp-{dead.pid}-0123abcd"
        writing = tmp_path / f".__1_{'b' * 32}.gdsckpt.gdsckpt-tmp-{alive.pid}-0123abcd"
        unrelated = tmp_path / f".notes.txt.gdsckpt-tmp-{dead.pid}-0123abcd"
        for path in (left, writing, unrelated):
            path.write_bytes(b"partial")
        save({"w": torch.arange(4.0) + 1}, tmp_path)
        assert not left.exists() and writing.exists() and unrelated.exists()
    finally:
        alive.kill()
        alive.wait()
    target = {"w": torch.zeros(4)}
    load(target, tmp_path)
    assert bits(target["w"]) == bits(torch.arange(4.0) + 1)
