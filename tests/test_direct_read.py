"""Direct reads on restore: ``none/1`` chunks whose bytes all go to one contiguous host range are
read straight into the destination array and checksummed there."""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt.errors import CorruptCheckpointError
from gdsckpt.io import PosixReader
from gdsckpt.pipeline import engine as engine_module
from gdsckpt.pipeline import load as load_module
from gdsckpt.state import NumpyTarget, TorchTarget


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(10_001, generator=g),  # ~10 chunks of 4096 bytes, the last one partial
        "half": torch.randn(5_000, generator=g).to(torch.bfloat16),
        "n": np.random.default_rng(7).standard_normal(3_001),
        "small": [torch.full((7,), float(i)) for i in range(5)],  # packed: several per chunk
        "step": 3,
    }


def _direct_chunks(index: Any) -> dict[int, str]:
    """Chunk -> key for chunks that qualify: chain none/1 and exactly one segment covering them."""
    segments: dict[int, list[tuple[str, Any]]] = {}
    for tensor in index.tensors:
        for segment in tensor.segments:
            segments.setdefault(segment.chunk, []).append((tensor.key, segment))
    direct = {}
    for chunk, found in segments.items():
        record = index.chunks[chunk]
        if (len(found) == 1 and index.chains[record.chain] == [{"name": "none/1"}]
                and found[0][1].raw_offset == 0 and found[0][1].length == record.raw):
            direct[chunk] = found[0][0]
    return direct


class _Counters:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.views = 0
        self.writes = 0
        self.buffers = 0
        for cls in (TorchTarget, NumpyTarget):
            monkeypatch.setattr(cls, "host_view", self._count_view(cls.host_view))
            monkeypatch.setattr(cls, "write_host", self._count_write(cls.write_host))
        original_buffer = engine_module.HostEngine.read_buffer

        def read_buffer(engine: Any, nbytes: int) -> Any:
            self.buffers += 1
            return original_buffer(engine, nbytes)

        monkeypatch.setattr(engine_module.HostEngine, "read_buffer", read_buffer)

    def _count_view(self, original: Any) -> Any:
        def host_view(target: Any, start: int, stop: int) -> Any:
            view = original(target, start, stop)
            if view is not None:
                self.views += 1
            return view
        return host_view

    def _count_write(self, original: Any) -> Any:
        def write_host(target: Any, start: int, data: Any) -> None:
            self.writes += 1
            original(target, start, data)
        return write_host


def test_none_chunks_are_read_straight_into_the_destination(ckpt_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            h: Any) -> None:
    config = h.small_config()
    gdsckpt.save(_state(), ckpt_path, codec="none", config=config)
    index = h.read_index(ckpt_path)
    direct = _direct_chunks(index)
    assert {"w", "half", "n"} <= set(direct.values()), "big arrays fill whole chunks"
    deliveries = sum(len(t.segments) for t in index.tensors if t.alias is None)
    counters = _Counters(monkeypatch)
    loaded = gdsckpt.load(ckpt_path, config=config)
    h.assert_same(_state(), loaded)
    assert counters.views == len(direct)
    assert counters.buffers == len(index.chunks) - len(direct), "no read buffer for a direct chunk"
    assert counters.writes == deliveries - len(direct), "no copy for a direct chunk"

    # a partial load takes the same path
    counters.views = 0
    partial = gdsckpt.load(ckpt_path, keys=["n"], config=config)
    assert np.array_equal(partial["n"], _state()["n"])
    assert counters.views >= sum(1 for key in direct.values() if key == "n")


def test_compressed_chunks_do_not_take_the_direct_path(ckpt_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       h: Any) -> None:
    config = h.small_config()
    state = {"zeros": torch.zeros(20_000), "w": torch.randn(5_000)}
    gdsckpt.save(state, ckpt_path, codec="zstd", config=config)
    index = h.read_index(ckpt_path)
    counters = _Counters(monkeypatch)
    h.assert_same(state, gdsckpt.load(ckpt_path, config=config))
    # incompressible chunks are stored as none/1 and read straight into their tensor; the
    # compressed ones are read into buffers of the engine's, then decoded into their tensor
    assert 0 < counters.buffers == len(index.chunks) - len(_direct_chunks(index))
    assert counters.views == len(index.chunks) and counters.writes == 0


@pytest.mark.parametrize("key", ["w", "n"])
def test_flipped_byte_in_a_direct_chunk_names_tensor_and_chunk(key: str, ckpt_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    config = h.small_config()
    gdsckpt.save(_state(), ckpt_path, codec="none", config=config)
    index = h.read_index(ckpt_path)
    chunk = [c for c, owner in sorted(_direct_chunks(index).items()) if owner == key][1]
    data = bytearray(ckpt_path.read_bytes())
    data[index.chunks[chunk].offset + 5] ^= 0x10
    ckpt_path.write_bytes(bytes(data))
    counters = _Counters(monkeypatch)
    with pytest.raises(CorruptCheckpointError) as caught:
        gdsckpt.load(ckpt_path, config=config)
    assert counters.views >= 1
    assert caught.value.key == key and caught.value.chunk == chunk
    assert f"chunk {chunk}" in str(caught.value) and key in str(caught.value)
    assert "checksum" in str(caught.value)


def test_only_the_cpu_engine_gets_direct_reads(ckpt_path: Path, h: Any) -> None:
    gdsckpt.save(_state(), ckpt_path, codec="none", config=h.small_config())
    index = h.read_index(ckpt_path)
    target = NumpyTarget((10_001,), "float32")
    deliveries = {chunk: [(0, 0, index.chunks[chunk].raw, 0)] for chunk in _direct_chunks(index)}
    targets = {0: target}
    assert load_module._whole_chunk_views(index, SimpleNamespace(name="gpu"), targets, deliveries) == {}
    cpu = load_module._whole_chunk_views(index, SimpleNamespace(name="cpu"), targets, deliveries)
    assert cpu and all(np.shares_memory(view, target.array) for view in cpu.values())


def test_host_view_of_targets() -> None:
    tensor_target = TorchTarget((4, 3), "float32", "cpu")
    view = tensor_target.host_view(8, 20)
    assert view is not None and view.nbytes == 12
    view[:] = np.arange(12, dtype=np.uint8)
    assert tensor_target.tensor.reshape(-1).view(torch.uint8)[8:20].tolist() == list(range(12))
    numpy_target = NumpyTarget((5,), "int16")
    numpy_view = numpy_target.host_view(2, 6)
    assert numpy_view is not None and np.shares_memory(numpy_view, numpy_target.array)
    existing = torch.zeros(6, 4).t()  # non-contiguous: filled through a contiguous copy
    into = TorchTarget((4, 6), "float32", "cpu", existing=existing)
    into_view = into.host_view(0, 4)
    assert into_view is not None and np.shares_memory(into_view, into.tensor.numpy())


def test_a_file_up_to_one_reader_bytes_not_in_the_page_cache_is_read_by_one_thread(tmp_path: Path) -> None:
    from gdsckpt.io.posix import ONE_READER_BYTES, in_page_cache

    small, large = tmp_path / "small.bin", tmp_path / "large.bin"
    small.write_bytes(bytes(range(256)) * 64)
    with open(large, "wb") as handle:  # sparse: its size is what counts
        handle.truncate(ONE_READER_BYTES + 1)
    small.read_bytes()
    with PosixReader(small, threads=4) as reader:
        assert in_page_cache(reader._fd, reader.size) is True
        assert reader._lane.threads == 4  # in the page cache: its reads are copies, on every thread
    fd = os.open(small, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        evicted = in_page_cache(fd, small.stat().st_size) is False
    finally:
        os.close(fd)
    if not evicted:
        pytest.skip("this filesystem keeps the file's pages cached (tmpfs) or cannot tell")
    with PosixReader(small, threads=4) as reader:
        assert reader._lane.threads == 1
        out = np.empty(4096, dtype=np.uint8)
        assert reader.submit_read(4096, out).result(10).tobytes() == (bytes(range(256)) * 16)
    with PosixReader(large, threads=4) as reader:
        assert reader._lane.threads == 4


def test_a_reader_whose_constructor_fails_after_the_open_closes_its_descriptor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error between opening the file and the end of ``PosixReader.__init__`` (here an EIO from
    the page-cache probe) leaves no descriptor open: nothing else could ever close it."""
    from gdsckpt.io import posix

    path = tmp_path / "file.bin"
    path.write_bytes(b"x" * 8192)

    def failing_probe(fd: int, size: int) -> bool:
        raise OSError(5, "injected EIO")

    monkeypatch.setattr(posix, "in_page_cache", failing_probe)
    def descriptors_of_the_file() -> list[str]:
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}") == str(path.resolve()):
                    found.append(fd)
            except FileNotFoundError:  # the listing's own descriptor, closed by now
                pass
        return found

    with pytest.raises(OSError, match="injected EIO"):
        PosixReader(path)
    assert descriptors_of_the_file() == []
    with open(path, "rb"):  # the check does see a descriptor that is open
        assert len(descriptors_of_the_file()) == 1


def test_an_interrupt_in_the_page_cache_probe_stays_an_interrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ^C handled right after the probe's ``mincore`` left its ctypes view of the mapping alive
    when the mapping closed: ``BufferError: cannot close exported pointers exist`` replaced the
    ``KeyboardInterrupt`` (a training loop's ``except KeyboardInterrupt`` missed it), from any load
    and any save over an existing file. Fault injection: ``mincore`` raising it."""
    from gdsckpt.io import posix

    path = tmp_path / "file.bin"
    path.write_bytes(b"x" * (4 * mmap.PAGESIZE))
    if posix._mincore is None:
        pytest.skip("no mincore here")

    def interrupted(*_args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(posix, "_mincore", interrupted)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(KeyboardInterrupt):
            posix.in_page_cache(fd, path.stat().st_size)
    finally:
        os.close(fd)
