"""Adversarial tests of the CPU engine's save and load paths: each test below but the last found a
bug (its docstring says which); the last guards a risky combination nothing else covers. Real
files and fsync; fakes only inject faults."""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gdsckpt

torch = pytest.importorskip("torch")


def _bits(tensor: Any) -> bytes:
    """The element bytes of a tensor in C order (NaN payloads and -0.0 included)."""
    if not tensor.numel():
        return b""
    plain = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.resolve_conj()).reshape(-1)
    return plain.view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------------------------------------
# load_into: a valid target torch calls contiguous whatever its stride


@pytest.mark.parametrize("make_target", [
    lambda: torch.zeros(2)[::2],        # shape (1,), stride (2,)
    lambda: torch.zeros(3, 4)[:1, 2],   # shape (1,), stride (4,): a column of a one-row matrix
], ids=["step-slice", "column"])
def test_load_into_a_one_element_view_with_a_stride_fills_it(tmp_path: Path, make_target: Any) -> None:
    """``TorchTarget`` (``state/arrays.py``) takes an existing tensor that ``is_contiguous()`` as
    its own memory and views it as bytes. torch calls a one-element tensor contiguous whatever
    its stride, but ``view`` to a smaller dtype needs stride 1: ``load_into`` of a valid file into
    a one-element slice (``w[::2]`` of length 1, a column of a one-row matrix) raised torch's
    ``RuntimeError`` instead of filling it (the save side handled it: ``TorchSource._part``)."""
    path = tmp_path / "one.gdsckpt"
    value = torch.tensor([-0.0], dtype=torch.float32)
    gdsckpt.save({"x": value}, path, config=gdsckpt.Config(codec="none"))
    target = make_target()
    assert target.numel() == 1 and target.is_contiguous() and target.stride(0) != 1
    gdsckpt.load_into({"x": target}, path)
    assert _bits(target) == _bits(value)


# ---------------------------------------------------------------------------------------------
# save into a file object: bytes the stream did not take are not "written"


def test_a_save_into_a_stream_that_would_block_is_not_reported_complete(tmp_path: Path) -> None:
    """``FileObjectWriter._put`` (``io/fileobj.py``) counted a ``write`` that returned None as
    having written everything it was given; for a raw non-blocking stream None means nothing was
    written, and the save returned a ``SaveReport`` of the whole file while the stream got a
    fraction of it. A save must either put the complete file into the stream or raise
    (``BlockingIOError``)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    received = bytearray()

    def drain() -> None:  # a slow consumer: the 64 KiB pipe fills while the save writes
        with open(read_fd, "rb", buffering=0) as reader:
            while True:
                time.sleep(0.002)
                part = reader.read(1 << 16)
                if not part:
                    return
                received.extend(part)

    consumer = threading.Thread(target=drain)
    consumer.start()
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}
    raised: BaseException | None = None
    report = None
    try:
        with open(write_fd, "wb", buffering=0) as stream:
            try:
                report = gdsckpt.save(state, stream, codec="none")
            except BlockingIOError as err:  # failing loudly is an acceptable outcome
                raised = err
    finally:
        consumer.join(10)
    if raised is None:
        assert report is not None
        assert len(received) == report.file_bytes, (
            f"save reported {report.file_bytes} bytes written, the stream received {len(received)}")
        assert _bits(gdsckpt.load(bytes(received))["w"]) == _bits(state["w"])


# ---------------------------------------------------------------------------------------------
# a hung chunk write fails the save after one timeout, naming the chunk


def test_a_save_whose_chunk_write_hangs_fails_after_one_timeout(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the first chunk's write never returns. The save fails with a
    ``TimeoutError`` naming that chunk after the driver's one wait, the writer's abort does not
    wait another timeout for the stuck write (``StorageWriter.stalled``: no wait of a lane's close
    runs out), and the file already at the path is kept. Before, the abort waited a second full
    timeout and the error was an empty ``TimeoutError``."""
    from gdsckpt.io import pools, posix

    path = tmp_path / "hung.gdsckpt"
    path.write_bytes(b"the previous checkpoint")
    release = threading.Event()
    hung: list[int] = []
    original = posix.pwrite_all

    def pwrite_all(fd: int, data: Any, offset: int) -> None:
        if not hung and memoryview(data).nbytes > 8192:  # the first chunk, not the header
            hung.append(offset)
            release.wait(30)
        original(fd, data, offset)

    original_v = posix.pwritev_all

    def pwritev_all(fd: int, buffers: list[Any], offset: int) -> None:  # joined O_DIRECT writes
        if not hung:
            hung.append(offset)
            release.wait(30)
        original_v(fd, buffers, offset)

    expired: list[float] = []
    close = pools.Lane.close

    def recorded_close(self: Any, timeout: float | None = None) -> bool:
        stopped = close(self, timeout)
        if not stopped and timeout:
            expired.append(timeout)  # a wait that ran its whole course
        return stopped

    monkeypatch.setattr(posix, "pwrite_all", pwrite_all)
    monkeypatch.setattr(posix, "pwritev_all", pwritev_all)
    monkeypatch.setattr(pools.Lane, "close", recorded_close)
    state = {"w": torch.from_numpy(np.random.default_rng(3).standard_normal(1 << 18).astype(np.float32))}
    config = gdsckpt.Config(chunk_bytes="256KiB", timeout=0.5, codec="none")
    try:
        with pytest.raises(TimeoutError, match=r"the write of chunk 0 \(of \d+ bytes\) did not complete within 0.5 s"):
            gdsckpt.save(state, path, config=config)
    finally:
        release.set()
    assert hung, "no chunk write was held"
    assert path.read_bytes() == b"the previous checkpoint"
    assert not expired, f"a close waited its whole timeout again: {expired}"


# ---------------------------------------------------------------------------------------------
# guard (passes): chunks written from the state's own memory, from temporaries, read back through
# every source kind and straight into existing tensors


def test_as_is_views_of_temporaries_round_trip_through_every_source(tmp_path: Path) -> None:
    """Passing guard for a risky combination nothing else covers together: ``codec="none"``
    hands the writer the state's own memory (``HostEngine.as_is_views``), here also the
    temporaries made for a transposed tensor, an expanded one and a big-endian NumPy array (the
    payload must keep them alive until written), mixed with O_DIRECT-eligible aligned chunks;
    the file is then read by path, ``bytes`` and ``BytesIO`` (direct reads into new arrays), by
    ``get_rows`` and by ``load_into`` into existing tensors (direct reads into the caller's
    memory), with NaN payloads and -0.0 compared bit for bit."""
    rng = np.random.default_rng(11)
    payloads = np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0x80000000], dtype=np.uint32)
    weights = torch.from_numpy(np.tile(payloads, 1 << 16).view(np.float32)).reshape(512, 512)
    state = {
        "t": weights.t(),                                               # non-contiguous: a copy per chunk
        "e": torch.tensor([-0.0]).expand(300_000),                       # zero stride
        "be": np.arange(200_000, dtype=">f8"),                           # byte-swapped copy per chunk
        "bf": torch.from_numpy(rng.integers(0, 1 << 16, 100_003, dtype=np.uint16).view(np.int16))
                   .view(torch.bfloat16),
        "aligned": torch.from_numpy(rng.standard_normal(1 << 18).astype(np.float32)),
    }
    path = tmp_path / "views.gdsckpt"
    config = gdsckpt.Config(chunk_bytes="64KiB", pack_below="16KiB", max_inflight_bytes="256KiB")
    report = gdsckpt.save(state, path, codec="none", config=config)
    assert report.chains == {"none/1": report.chunks}

    def check(loaded: dict[str, Any]) -> None:
        for key, value in state.items():
            if isinstance(value, np.ndarray):
                assert loaded[key].tobytes() == value.astype("<f8").tobytes(), key
            else:
                assert _bits(loaded[key]) == _bits(value), key

    data = path.read_bytes()
    for source in (path, data, io.BytesIO(data)):
        check(gdsckpt.load(source, config=config))
    with gdsckpt.open(io.BytesIO(data), config=config) as checkpoint:
        assert _bits(checkpoint.get_rows("t", 100, 400)) == _bits(state["t"][100:400])
    targets = {key: torch.zeros(value.shape, dtype=value.dtype) for key, value in state.items()
               if isinstance(value, torch.Tensor)}
    gdsckpt.load_into(targets, path, strict=False, config=config)
    for key, target in targets.items():
        assert _bits(target) == _bits(state[key]), key
