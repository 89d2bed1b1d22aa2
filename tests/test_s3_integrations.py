"""What builds on ``s3://`` checkpoints, against a real S3 server (SeaweedFS, ``tests/seaweed.py``)
that checks credentials (so that wrong ones fail):

- ``CheckpointManager(directory, remote="s3://...")``: saves complete on the local tier and are
  uploaded in the background; a new node restores from the remote tier; faults (the server killed
  during an upload, stopped, restarted, a missing bucket, wrong credentials, damaged objects, a
  ``latest`` naming a missing object) lose nothing and say what happened;
- torch.distributed.checkpoint through ``GdsStorageWriter`` / ``GdsStorageReader`` at a URL;
- ``convert`` (library and command line) from and to URLs."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import obstore
import pytest
import torch
from seaweed import SeaweedServer, serving_bucket

import gdsckpt
from gdsckpt.errors import CheckpointError, RemoteUploadError, RemoteUploadWarning, SkippedCheckpointWarning
from gdsckpt.io.s3 import DENIED_HINT, ObjectDirectory, open_store

BUCKET = "ckpt"
KEY, SECRET = "gdsckpt-test", "gdsckpt-test-secret"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A running server with bucket ``ckpt``, the AWS environment pointing at it for the module.
    A test that stops it starts it again before it ends."""
    with serving_bucket(tmp_path_factory.mktemp("seaweedfs"), BUCKET, (KEY, SECRET)) as weed:
        yield weed


@pytest.fixture
def remote(server: SeaweedServer, request: pytest.FixtureRequest) -> str:
    """A prefix of its own for each test."""
    return f"s3://{BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}"


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(200, 129, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)},
            "optimizer": {"m": torch.randn(200, 129, generator=g)}, "step": seed}


def _trained(steps: int) -> list[dict[str, Any]]:
    """States of a run: small updates of one set of weights (so that deltas are small)."""
    states = [_state(0)]
    for step in range(1, steps):
        previous = states[-1]
        states.append({"model": {"w": previous["model"]["w"] + 1e-3 * step, "b": previous["model"]["b"]},
                       "optimizer": {"m": previous["optimizer"]["m"] * 0.9}, "step": step})
    return states


def _objects(url: str) -> dict[str, int]:
    return ObjectDirectory(url).names()


def _object_bytes(url: str) -> bytes:
    bucket, _slash, key = url[len("s3://"):].partition("/")
    return bytes(obstore.get(open_store(bucket), key).bytes())


def test_each_save_is_uploaded_and_a_new_node_restores_from_the_remote_tier(remote: str, tmp_path: Path,
                                                                             h: Any) -> None:
    states = _trained(5)
    manager = gdsckpt.CheckpointManager(tmp_path / "node-a", remote=remote, keep_last=2, keep_last_remote=3)
    for step in range(1, 5):
        if step % 2:
            manager.save(step, states[step])
        else:
            manager.save_async(step, states[step])
    manager.wait()
    assert manager.pending_uploads() == [] and manager.remote_steps() == [2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "node-a").glob("*.gdsckpt")) == [manager.path(3).name,
                                                                                 manager.path(4).name]
    names = _objects(remote)
    assert set(names) == {manager.path(s).name for s in (2, 3, 4)} | {"latest"}
    assert _object_bytes(f"{remote}/latest") == (manager.path(4).name + "\n").encode()
    for step in (3, 4):  # uploaded as they are, not re-encoded
        assert _object_bytes(f"{remote}/{manager.path(step).name}") == manager.path(step).read_bytes()

    fresh = gdsckpt.CheckpointManager(tmp_path / "node-b", remote=remote)
    restored = fresh.restore_latest()
    assert restored is not None and restored[0] == 4
    h.assert_same(states[4], restored[1])
    target = {"model": {"w": torch.zeros(200, 129), "b": torch.zeros(7, dtype=torch.bfloat16)}}
    step, extra = fresh.restore_latest(state=target)
    assert step == 4 and set(extra) == {"optimizer", "step"}
    h.assert_same(states[4]["model"], target["model"])


def test_deltas_go_up_with_their_bases_and_restore_from_the_remote_tier(remote: str, tmp_path: Path,
                                                                        h: Any) -> None:
    """Delta 3 needs 2, which needs full 1: with keep_last_remote=1 all three stay remote until
    full checkpoint 4 makes them unneeded."""
    states = _trained(5)
    manager = gdsckpt.CheckpointManager(tmp_path / "a", remote=remote, keep_last=1, keep_last_remote=1,
                                        delta_every=1, full_every=4)
    for step in (1, 2, 3):
        manager.save(step, states[step])
    manager.wait()
    assert gdsckpt.inspect(manager.path(3)).base is not None
    assert manager.remote_steps() == [1, 2, 3]
    restored = gdsckpt.CheckpointManager(tmp_path / "b", remote=remote).restore_latest()
    assert restored is not None and restored[0] == 3
    h.assert_same(states[3], restored[1])
    h.assert_same(states[3], gdsckpt.load(f"{remote}/{manager.path(3).name}"))  # a URL delta finds its base

    manager.save(4, states[4])
    manager.wait()
    assert manager.remote_steps() == [4]


def test_server_killed_during_an_upload_loses_nothing(server: SeaweedServer, remote: str, tmp_path: Path,
                                                      h: Any) -> None:
    """The server dies after the first part of step 2's upload: no object appears for it, step 1
    stays restorable from the remote tier, step 2 stays on the local tier, ``wait`` says so, and
    the next save (the server back) uploads both."""
    states = _trained(4)
    manager = gdsckpt.CheckpointManager(tmp_path / "a", remote=remote, keep_last=1, keep_last_remote=2,
                                        config=gdsckpt.Config(chunk_bytes=64 << 10))
    manager.save(1, states[1])
    manager.wait()
    assert manager.remote.upload.__func__ is ObjectDirectory.upload

    def upload_killing_the_server(path: Any, name: str) -> None:
        def parts() -> Iterator[bytes]:
            with open(path, "rb") as handle:
                yield handle.read(64 << 10)
                server.stop(kill=True)  # fault injection: a real server, killed mid-upload
                while part := handle.read(64 << 10):
                    yield part
        obstore.put(manager.remote.store, manager.remote.prefix + name, parts(), use_multipart=True,
                    chunk_size=5 << 20)
    manager.remote.upload = upload_killing_the_server  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RemoteUploadWarning)
            manager.save(2, _big(states[2]))
            with pytest.raises(RemoteUploadError, match=r"lacks checkpoint step\(s\) \[2\]"):
                manager.wait()
        assert manager.pending_uploads() == [2] and manager.path(2).is_file()
    finally:
        del manager.remote.upload
        server.start()
    assert set(_objects(remote)) == {manager.path(1).name, "latest"}
    restored = gdsckpt.CheckpointManager(tmp_path / "b", remote=remote).restore_latest()
    assert restored is not None and restored[0] == 1
    h.assert_same(states[1], restored[1])

    manager.save(3, states[3])
    manager.wait()
    assert manager.pending_uploads() == [] and manager.remote_steps() == [2, 3]
    h.assert_same(_big(states[2]), gdsckpt.load(f"{remote}/{manager.path(2).name}"))


def test_a_save_whose_abort_cannot_reach_the_server_says_so(server: SeaweedServer, remote: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The server killed while a save's parts go up: the save fails, and so does the abort its
    failure starts (nobody answers). obstore then reports the abort's DELETE, not the part that
    failed; the error says the upload failed, its abort too, and what removes the parts left."""
    from gdsckpt.io import s3

    writes = 0
    submit_write = s3.S3Writer.submit_write

    def submit_write_killing_the_server(self: Any, offset: int, data: Any) -> Any:
        nonlocal writes
        writes += 1
        if writes == 8:
            server.stop(kill=True)  # fault injection: a real server, killed mid-upload
        return submit_write(self, offset, data)

    monkeypatch.setattr(s3.S3Writer, "submit_write", submit_write_killing_the_server)
    try:
        with pytest.raises((CheckpointError, TimeoutError)) as failure:
            gdsckpt.save({"w": torch.arange(12 << 20, dtype=torch.float32)}, f"{remote}/a.gdsckpt",
                         config=gdsckpt.Config(codec="none", chunk_bytes=4 << 20, timeout=5))
    finally:
        server.start()
    assert "aborting it" in str(failure.value) and "lifecycle rule" in str(failure.value), failure.value


def _big(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with 12 MiB more, so that its file spans several upload parts."""
    return {**state, "extra": torch.arange(3 << 20, dtype=torch.float32)}


def test_server_down_then_restarted_between_save_and_restore(server: SeaweedServer, remote: str,
                                                             tmp_path: Path, h: Any) -> None:
    """Saves while the server is down complete locally (pruning keeps them: they are the only
    copy); ``wait`` raises; once the server is back ``wait`` uploads them, and a restore after a
    further restart reads them."""
    states = _trained(4)
    manager = gdsckpt.CheckpointManager(tmp_path / "a", remote=remote, keep_last=1, keep_last_remote=5)
    server.stop()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RemoteUploadWarning)
            manager.save(1, states[1])
            manager.save(2, states[2])
            with pytest.raises(RemoteUploadError) as raised:
                manager.wait()
        assert remote.split("/")[2] in str(raised.value) and manager.pending_uploads() == [1, 2]
        assert manager.path(1).is_file() and manager.path(2).is_file()  # keep_last=1, yet both kept
    finally:
        server.start()
    manager.wait()
    assert manager.remote_steps() == [1, 2] and manager.pending_uploads() == []
    manager.save(3, states[3])
    assert not manager.path(1).exists()  # uploaded: pruned locally now
    manager.wait()
    server.stop()
    server.start()
    restored = gdsckpt.CheckpointManager(tmp_path / "b", remote=remote).restore_latest()
    assert restored is not None and restored[0] == 3
    h.assert_same(states[3], restored[1])


def test_missing_bucket_is_reported_and_the_local_tier_keeps_working(server: SeaweedServer, tmp_path: Path,
                                                                     h: Any) -> None:
    manager = gdsckpt.CheckpointManager(tmp_path, remote="s3://no-such-bucket/run")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        manager.save(1, _state(1))
        with pytest.raises(RemoteUploadError, match="no-such-bucket"):
            manager.wait()
    restored = manager.restore_latest()
    assert restored is not None and restored[0] == 1
    h.assert_same(_state(1), restored[1])
    with pytest.raises((FileNotFoundError, CheckpointError), match="no-such-bucket"):
        gdsckpt.load("s3://no-such-bucket/x.gdsckpt")


def test_wrong_credentials_are_a_clear_error_and_write_nothing(remote: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"{remote}/x.gdsckpt"
    gdsckpt.save(_state(1), url)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    # each says the credentials were refused, whichever request the server refused first (a
    # save's first is a HEAD of its target, a manager's a listing)
    denied = re.escape(DENIED_HINT)
    with pytest.raises(CheckpointError, match=f"{denied}.*(PermissionDenied|403)") as caught:
        gdsckpt.save(_state(2), f"{remote}/y.gdsckpt")
    assert "cannot read" not in str(caught.value)  # a save that read nothing
    with pytest.raises(CheckpointError, match=f"{denied}.*(PermissionDenied|403)"):
        gdsckpt.load(url)
    manager = gdsckpt.CheckpointManager(tmp_path, remote=remote)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        manager.save(5, _state(5))
        with pytest.raises(RemoteUploadError, match=f"{denied}.*(PermissionDenied|403)"):
            manager.wait()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    assert set(_objects(remote)) == {"x.gdsckpt"}


def test_damaged_objects_and_a_pointer_to_a_missing_one_are_passed_over(remote: str, tmp_path: Path,
                                                                        h: Any) -> None:
    """The remote ``latest`` names a step whose object is gone, the newest object is corrupted,
    the next one truncated: a new node restores the one before, warning about each."""
    states = _trained(5)
    manager = gdsckpt.CheckpointManager(tmp_path / "a", remote=remote, keep_last_remote=None)
    for step in range(1, 5):
        manager.save(step, states[step])
    manager.wait()
    directory = ObjectDirectory(remote)
    name = {step: manager.path(step).name for step in range(1, 6)}
    directory.write_small("latest", (name[5] + "\n").encode())
    data = bytearray(_object_bytes(f"{remote}/{name[4]}"))
    data[len(data) // 3] ^= 0x40
    directory.write_small(name[4], bytes(data))
    directory.write_small(name[3], _object_bytes(f"{remote}/{name[3]}")[:-100])
    with pytest.warns(SkippedCheckpointWarning) as caught:
        restored = gdsckpt.CheckpointManager(tmp_path / "b", remote=remote).restore_latest(verify=True)
    assert restored is not None and restored[0] == 2
    h.assert_same(states[2], restored[1])
    said = "\n".join(str(w.message) for w in caught)
    assert name[5] in said and name[4] in said and name[3] in said

    # pruning passes over the damaged objects as needing no base, and removes them
    pruning = gdsckpt.CheckpointManager(tmp_path / "c", remote=remote, keep_last_remote=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RemoteUploadWarning)
        pruning.save(6, states[4])
        pruning.wait()
    assert pruning.remote_steps() == [6]


def test_remote_pruning_removes_only_this_managers_checkpoints(remote: str, tmp_path: Path) -> None:
    directory = ObjectDirectory(remote)
    directory.write_small("notes.txt", b"keep me")
    directory.write_small("other-0000000001.gdsckpt", b"not ours")
    manager = gdsckpt.CheckpointManager(tmp_path, remote=remote, keep_last_remote=1)
    for step in (1, 2, 3):
        manager.save(step, _state(step))
    manager.wait()
    assert set(_objects(remote)) == {"notes.txt", "other-0000000001.gdsckpt", "latest", manager.path(3).name}


def test_dcp_two_ranks_save_through_s3_and_one_rank_loads_resharded(remote: str, tmp_path: Path) -> None:
    """torch.distributed.checkpoint with ``GdsStorageWriter`` / ``GdsStorageReader`` at an
    ``s3://`` prefix: two gloo ranks save (a DTensor sharded over both, replicated tensors, plain
    values), one rank loads it all back bit-exact (``test_dcp._check``)."""
    from test_dcp import spawn

    url = f"{remote}/dcp"
    saved = spawn(2, tmp_path, "s3-save", [("save", url)])
    assert [report[f"save:{url}"] for report in saved] == [None, None]
    objects = set(_objects(url))  # one object per rank, named with its save's file id
    assert {name for name in objects if not name.startswith("__")} == {".metadata", ".metadata.json"}
    assert sorted(re.sub(r"_[0-9a-f]{32}\.", "_<id>.", name) for name in objects if name.startswith("__")) \
        == ["__0_<id>.gdsckpt", "__1_<id>.gdsckpt"]
    loaded = spawn(1, tmp_path, "s3-load", [("load", url)])
    assert loaded[0][f"load:{url}"] is None


def test_convert_from_and_to_urls(remote: str, tmp_path: Path, h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """gdsckpt -> gdsckpt between a file and objects (streamed, recompressed), a safetensors file
    into an object, an object out to a torch file; objects of other formats are refused."""
    state = {"w": torch.randn(300, 100, generator=torch.Generator().manual_seed(3)), "i": torch.arange(50)}
    local = tmp_path / "a.gdsckpt"
    gdsckpt.save(state, local, codec="zstd")
    up = f"{remote}/a.gdsckpt"
    report = gdsckpt.convert(local, up, codec="lz4")
    assert report.codec == "lz4" and report.dst_bytes == gdsckpt.inspect(up).file_bytes > 0
    h.assert_same(state, gdsckpt.load(up))
    with pytest.raises(FileExistsError, match="exists"):
        gdsckpt.convert(local, up)
    gdsckpt.convert(up, f"{remote}/b.gdsckpt", codec="none")
    h.assert_same(state, gdsckpt.load(f"{remote}/b.gdsckpt"))
    # gdsckpt to gdsckpt streams the arrays (api.saving.rewrite) whichever side is an object: the
    # whole-state reader of the other conversions must not run
    from gdsckpt.integrations import convert as convert_module

    def whole_state(*_args: Any) -> Any:
        raise AssertionError("a gdsckpt-to-gdsckpt conversion loaded the whole state")
    monkeypatch.setitem(convert_module._READERS, "gdsckpt", whole_state)
    down = gdsckpt.convert(up, tmp_path / "down.gdsckpt", codec="zstd")
    assert down.dst_bytes == (tmp_path / "down.gdsckpt").stat().st_size and down.src_bytes == report.dst_bytes
    h.assert_same(state, gdsckpt.load(tmp_path / "down.gdsckpt"))
    monkeypatch.undo()
    gdsckpt.convert(f"{remote}/b.gdsckpt", tmp_path / "b.pt")
    h.assert_same(state, torch.load(tmp_path / "b.pt", weights_only=True))
    from safetensors.torch import save_file
    save_file(state, tmp_path / "c.safetensors")
    gdsckpt.convert(tmp_path / "c.safetensors", f"{remote}/c.gdsckpt")
    h.assert_same(dict(sorted(state.items())), gdsckpt.load(f"{remote}/c.gdsckpt"))  # safetensors sorts keys
    with pytest.raises(ValueError, match="gdsckpt only"):
        gdsckpt.convert(local, f"{remote}/x.safetensors")
    done = subprocess.run([sys.executable, "-m", "gdsckpt", "convert", up, f"{remote}/cli.gdsckpt", "--codec",
                           "zstd"], capture_output=True, text=True, timeout=120, env=h.subprocess_env())
    assert done.returncode == 0, done.stderr
    h.assert_same(state, gdsckpt.load(f"{remote}/cli.gdsckpt"))


def test_rebase_and_replacing_a_base_object(remote: str, tmp_path: Path, h: Any) -> None:
    """A delta object finds its base beside it; replacing that base (save, convert, in-place
    rebase) is refused while the delta needs it; ``rebase`` makes the delta a full object."""
    states = _trained(3)
    full, delta = f"{remote}/full.gdsckpt", f"{remote}/delta.gdsckpt"
    gdsckpt.save(states[1], full)
    # the delta is written locally against a byte-identical copy of the base object, then uploaded
    (tmp_path / "full.gdsckpt").write_bytes(_object_bytes(full))
    gdsckpt.save(states[2], tmp_path / "delta.gdsckpt", base=tmp_path / "full.gdsckpt")
    ObjectDirectory(remote).upload(tmp_path / "delta.gdsckpt", "delta.gdsckpt")
    assert gdsckpt.inspect(delta).base is not None
    h.assert_same(states[2], gdsckpt.load(delta))
    with pytest.raises(gdsckpt.DeltaBaseError, match="delta.gdsckpt"):
        gdsckpt.save(states[0], full)
    with pytest.raises(gdsckpt.DeltaBaseError, match="delta.gdsckpt"):
        gdsckpt.convert(delta, full, overwrite=True)
    with pytest.raises(gdsckpt.DeltaBaseError, match="delta.gdsckpt"):
        gdsckpt.rebase(full)
    report = gdsckpt.rebase(delta)
    assert report.path == delta and gdsckpt.inspect(delta).base is None
    h.assert_same(states[2], gdsckpt.load(delta))
    gdsckpt.save(states[0], full)  # no delta needs it now
    h.assert_same(states[2], gdsckpt.load(delta))


def test_a_manager_of_objects_only(remote: str, h: Any) -> None:
    """``CheckpointManager("s3://...")``: saves (and async saves) go straight into objects,
    ``latest`` and pruning work there, a new manager restores; remote= is refused."""
    states = _trained(4)
    manager = gdsckpt.CheckpointManager(remote, keep_last=2)
    manager.save(1, states[1])
    manager.save_async(2, states[2]).wait(timeout=120)
    manager.save(3, states[3])
    manager.wait()
    assert manager.path(3) == f"{remote}/{manager._name(3)}"
    assert set(_objects(remote)) == {manager._name(2), manager._name(3), "latest"}
    assert _object_bytes(f"{remote}/latest") == (manager._name(3) + "\n").encode()
    assert manager.steps() == [2, 3] and manager.latest_step() == 3
    restored = gdsckpt.CheckpointManager(remote).restore_latest()
    assert restored is not None and restored[0] == 3
    h.assert_same(states[3], restored[1])
    with pytest.raises(ValueError, match="remote="):
        gdsckpt.CheckpointManager(remote, remote=remote)


def test_deltas_with_their_bases_as_objects(remote: str, tmp_path: Path, h: Any) -> None:
    """A delta saved to an object against another object names it by its name (beside it); a
    local delta against an object names its URL; a manager of objects only writes deltas, keeps
    their bases, and restores through them."""
    states = _trained(6)
    base, delta = f"{remote}/base.gdsckpt", f"{remote}/delta.gdsckpt"
    gdsckpt.save(states[1], base)
    report = gdsckpt.save(states[2], delta, base=base)
    assert report.base == "base.gdsckpt" and report.delta_tensors > 0  # beside it: by name
    h.assert_same(states[2], gdsckpt.load(delta))
    below = gdsckpt.save(states[2], f"{remote}/sub/delta.gdsckpt", base=base)
    assert below.base == base  # not beside or below the delta: the URL, as an absolute path would be
    h.assert_same(states[2], gdsckpt.load(f"{remote}/sub/delta.gdsckpt"))
    local = tmp_path / "local-delta.gdsckpt"
    assert gdsckpt.save(states[2], local, base=base).base == base
    h.assert_same(states[2], gdsckpt.load(local))
    with pytest.raises(gdsckpt.DeltaBaseError, match="does not exist"):
        gdsckpt.save(states[2], f"{remote}/x.gdsckpt", base=f"{remote}/missing.gdsckpt")
    with pytest.raises(gdsckpt.DeltaBaseError, match="is the base of"):  # delta.gdsckpt needs it
        gdsckpt.save(states[2], base, base=base)
    with pytest.raises(ValueError, match="own base"):
        gdsckpt.save(states[2], base, base=base, force=True)

    managed = f"{remote}/managed"
    manager = gdsckpt.CheckpointManager(managed, keep_last=1, delta_every=1, full_every=3)
    for step in range(1, 6):
        manager.save(step, states[step])
    manager.wait()
    # 3 is full, 4 a delta on 3, 5 a delta on 4: keep_last=1 keeps 5 and the chain it needs
    assert manager.remote_steps() == [3, 4, 5]
    assert gdsckpt.inspect(manager.path(5)).base["path"] == manager._name(4)
    restored = gdsckpt.CheckpointManager(managed).restore_latest()
    assert restored is not None and restored[0] == 5
    h.assert_same(states[5], restored[1])


def test_remote_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="s3://"):
        gdsckpt.CheckpointManager(tmp_path, remote="/mnt/backup")
    with pytest.raises(ValueError, match="keep_last_remote"):
        gdsckpt.CheckpointManager(tmp_path, remote="s3://b/p", keep_last_remote=0)
    with pytest.raises(ValueError, match="bucket"):
        gdsckpt.CheckpointManager(tmp_path, remote="s3:///p")


def test_a_manager_with_a_remote_tier_compresses_where_the_local_disk_alone_would_not(
        remote: str, tmp_path: Path, h: Any) -> None:
    """``codec="auto"`` stores host state as it is where the codec threads are slower than the
    local disk (``gdsckpt.pipeline.host_auto``); with a remote tier the same file is uploaded
    too, so the manager's saves stay compressed."""
    import os

    from gdsckpt.pipeline.host_auto import HISTORY, MEASURED_MIN_BYTES

    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(MEASURED_MIN_BYTES // 16, generator=g) * 0.02 for i in range(4)}
    fast_disk = gdsckpt.Config(storage_gbps=1e6)
    for directory in (tmp_path / "local-only", tmp_path / "two-tier"):
        directory.mkdir()
        key = f"dev:{os.stat(directory).st_dev}"
        HISTORY.record(key, MEASURED_MIN_BYTES, 1e-6)  # a pace far below the disk's
        HISTORY.record(key, MEASURED_MIN_BYTES, None)
    local = gdsckpt.CheckpointManager(tmp_path / "local-only", config=fast_disk)
    report = local.save(1, state)
    assert report.auto["stored"] == "as it is" and report.codec == "none"
    both = gdsckpt.CheckpointManager(tmp_path / "two-tier", remote=remote, config=fast_disk)
    report = both.save(1, state)
    assert "stored" not in report.auto and report.codec == "zstd" and report.auto["adaptive"]
    both.wait(timeout=120)
    step, restored = gdsckpt.CheckpointManager(tmp_path / "new-node", remote=remote).restore_latest()
    assert step == 1
    h.assert_same(state, restored)


def test_an_upload_the_server_answers_not_found_stays_pending(remote: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A 404 from the server during an upload (its multipart upload aborted under it by a
    lifecycle rule; injected here) was taken for the local file pruned: the step left the pending
    set without a word and ``wait()`` reported success with the remote tier lacking it."""
    manager = gdsckpt.CheckpointManager(tmp_path / "node", remote=remote, keep_last=2)
    real_put = obstore.put

    def not_found(*args: Any, **kwargs: Any) -> Any:
        raise FileNotFoundError("NoSuchUpload (injected)")

    monkeypatch.setattr(obstore, "put", not_found)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RemoteUploadWarning)
        manager.save(1, _state(1))
        with pytest.raises(RemoteUploadError, match="lacks checkpoint step"):
            manager.wait(timeout=60)
    assert manager.pending_uploads() == [1] and manager.remote_steps() == []
    monkeypatch.setattr(obstore, "put", real_put)
    manager.wait(timeout=60)  # retried
    assert manager.remote_steps() == [1] and manager.pending_uploads() == []


def test_a_rollback_moves_the_remote_latest_down_too(remote: str, tmp_path: Path, h: Any) -> None:
    """Steps 10, 20, 30, then 20 again and 21 (a run gone back to an older step): the local
    ``latest`` names 21, and the remote one named 30, the abandoned step, which a replacement
    node then restored (the uploads of one round go oldest first, 30 last)."""
    objects = f"{remote}-objects"
    for directory in (gdsckpt.CheckpointManager(tmp_path / "node", remote=remote, keep_last=3, keep_last_remote=3),
                      gdsckpt.CheckpointManager(objects, keep_last=3)):
        for step in (10, 20, 30):
            directory.save(step, _state(step))
        directory.save(20, _state(1020))
        directory.save(21, _state(1021))
        directory.wait(timeout=60)
    for manager in (gdsckpt.CheckpointManager(tmp_path / "replacement", remote=remote), gdsckpt.CheckpointManager(objects)):
        restored = manager.restore_latest()
        assert restored is not None and restored[0] == 21
        h.assert_same(_state(1021), restored[1])


def test_the_newest_step_damaged_on_both_tiers_falls_back_to_an_older_one(remote: str, tmp_path: Path,
                                                                          h: Any) -> None:
    """A file damaged before its upload is damaged on both tiers: the remote copy of a remote
    candidate was asked for again and again, and restore never returned."""
    import threading

    manager = gdsckpt.CheckpointManager(tmp_path / "node", remote=remote, keep_last=3, keep_last_remote=3)
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    manager.wait(timeout=60)
    name = manager.path(2).name
    data = bytearray(manager.path(2).read_bytes())
    data[4096 + 10] ^= 0xFF  # inside the first chunk
    manager.path(2).write_bytes(bytes(data))
    bucket, _slash, prefix = remote[len("s3://"):].partition("/")
    obstore.put(open_store(bucket), f"{prefix}/{name}", bytes(data))
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(gdsckpt.CheckpointManager(tmp_path / "node", remote=remote)
                                                           .restore_latest()), daemon=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedCheckpointWarning)
        thread.start()
        thread.join(60)
    assert result, "restore_latest did not return within 60 s"
    assert result[0] is not None and result[0][0] == 1
    h.assert_same(_state(1), result[0][1])


def test_an_object_deleted_while_read_is_gone_not_an_io_error(remote: str) -> None:
    """A concurrent prune deleting an object after its reader opened it: a plain
    ``CheckpointError`` ("I/O error"), which ``restore_latest`` raises, where the local tier's
    vanished file is passed over."""
    url = f"{remote}/step-0000000001.gdsckpt"
    gdsckpt.save({"w": torch.arange(1000.0)}, url)
    bucket, _slash, key = url[len("s3://"):].partition("/")
    with gdsckpt.open(url) as checkpoint:
        obstore.delete(open_store(bucket), key)
        with pytest.raises(FileNotFoundError, match="deleted while it was read"):
            checkpoint.get("w")


@pytest.mark.parametrize("prefix", ["run//a", "./run", "run/../a"])
def test_a_prefix_the_client_would_change_is_refused_at_once(server: SeaweedServer, tmp_path: Path,
                                                              prefix: str) -> None:
    with pytest.raises(ValueError, match="path segment"):
        gdsckpt.CheckpointManager(tmp_path / "node", remote=f"s3://{BUCKET}/{prefix}")
    with pytest.raises(ValueError, match="path segment"):
        gdsckpt.CheckpointManager(f"s3://{BUCKET}/{prefix}")


_PRUNING_WRITER = """
import sys, warnings, torch, gdsckpt
warnings.simplefilter("ignore")
manager = gdsckpt.CheckpointManager(sys.argv[1], keep_last=1)
step = 0
while True:
    step += 1
    manager.save(step, {"model": {"w": torch.full((256,), float(step))}})
"""


def test_restoring_objects_another_process_prunes_as_fast_as_it_saves(remote: str) -> None:
    """A reader of a tier whose saver keeps one checkpoint (``keep_last=1``) finds every object it
    listed pruned before it reads it: the remote tier was listed once, and ``restore_latest``
    returned ``None``, a fresh start (the first restore, each of 4 runs)."""
    import os
    import time

    writer = subprocess.Popen([sys.executable, "-c", _PRUNING_WRITER, remote], env=dict(os.environ))
    try:
        reader = gdsckpt.CheckpointManager(remote, keep_last=1)
        deadline = time.monotonic() + 60
        while not reader.remote_steps() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert writer.poll() is None, "the writer stopped"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SkippedCheckpointWarning)
            for _ in range(5):
                restored = reader.restore_latest()
                assert restored is not None
                step, state = restored
                assert torch.equal(state["model"]["w"], torch.full((256,), float(step)))
    finally:
        writer.kill()
        writer.wait()


def test_after_a_rollback_the_remote_latest_goes_below_the_abandoned_step(remote: str, tmp_path: Path) -> None:
    """Steps 1-10 uploaded, a rollback to 5, then 5 and 6 saved: 5 goes up once the local latest
    is 6, and the node dies before 6's upload. The remote latest stayed on the abandoned 10 (an
    upload below the local latest moved it only above the remote one), which a replacement node
    restored; it names 5 now."""
    import threading

    manager = gdsckpt.CheckpointManager(tmp_path / "node", remote=remote)
    for step in range(1, 11):
        manager.save(step, {"w": torch.full((4,), float(step)), "step": step})
    manager.wait(timeout=60)
    six_saved = threading.Event()
    upload = manager.remote.upload

    def node_dies_before_six(path: Any, name: str) -> None:
        if name == manager.path(5).name:
            six_saved.wait(30)
        if name == manager.path(6).name:
            raise OSError("the node died (injected) before this upload")
        upload(path, name)

    manager.remote.upload = node_dies_before_six
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RemoteUploadWarning)
        manager.save(5, {"w": torch.full((4,), 50.0), "step": 5})
        manager.save(6, {"w": torch.full((4,), 60.0), "step": 6})
        six_saved.set()
        with pytest.raises(RemoteUploadError):
            manager.wait(timeout=60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedCheckpointWarning)
        restored = gdsckpt.CheckpointManager(tmp_path / "replacement", remote=remote).restore_latest()
    assert restored is not None and restored[0] == 5 and torch.equal(restored[1]["w"], torch.full((4,), 50.0))


def test_objects_only_deltas_after_a_rollback_keep_the_base_the_new_step_needs(remote: str, h: Any) -> None:
    """Steps 10 (full) and 20 (a delta on 10), a rollback to 15 (a delta on 10), 20 again (a delta
    on 15, the same size as the old 20) and 21: pruning trusted its cached "20 needs 10" and
    removed 15, so the newest checkpoint no longer loaded and a restore fell back to 10."""
    manager = gdsckpt.CheckpointManager(remote, keep_last=1, delta_every=1)

    def state(value: int) -> dict[str, Any]:
        return {"w": torch.full((1000,), float(value))}

    for step, value in ((10, 10), (20, 20), (15, 15), (20, 21), (21, 22)):
        manager.save(step, state(value), codec="none")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkippedCheckpointWarning)
        restored = gdsckpt.CheckpointManager(remote).restore_latest()
    assert restored is not None and restored[0] == 21
    h.assert_same(state(22), restored[1])


def test_latest_step_on_a_replacement_node_names_the_remote_step_restore_takes(remote: str,
                                                                                tmp_path: Path) -> None:
    node = gdsckpt.CheckpointManager(tmp_path / "a", remote=remote)
    node.save(7, _state(7))
    node.wait(timeout=60)
    replacement = gdsckpt.CheckpointManager(tmp_path / "b", remote=remote)
    assert replacement.latest_step() == 7
    restored = replacement.restore_latest()
    assert restored is not None and restored[0] == 7
