"""The CPU engine decoding a chunk straight into the one destination that takes it whole
(``Decoder.submit_decode``'s ``into``; ``decode_host_chunk(out=...)``; the byte-plane inverse
writing the destination's memory): the same bytes as decoding into a new array, nothing written
into a destination by a chunk that fails its checks, and which chunks of a restore take it."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gdsckpt
from gdsckpt.codecs import host_codec
from gdsckpt.codecs.base import transform
from gdsckpt.codecs.cpu import ZstdCodec, planes_forward, planes_inverse, planes_inverse_reference
from gdsckpt.errors import CorruptCheckpointError
from gdsckpt.format import checksum
from gdsckpt.format.index import ChunkRecord
from gdsckpt.io import PosixReader
from gdsckpt.pipeline.engine import HostEngine, decode_host_chunk
from gdsckpt.pipeline.load import open_file, run_restore
from gdsckpt.state import NumpyTarget


@pytest.mark.parametrize("width", [2, 4, 8])
def test_planes_inverse_into_an_array_gives_the_reference_bytes(width: int) -> None:
    raw = np.random.default_rng(width).integers(0, 256, 4096 * width, dtype=np.uint8)
    planes = planes_forward(raw, width)
    out = np.zeros(raw.size, dtype=np.uint8)
    assert planes_inverse(planes, width, out) is out
    assert out.tobytes() == planes_inverse_reference(planes, width).tobytes() == raw.tobytes()


def test_planes_inverse_refuses_an_array_of_another_size_before_writing_it() -> None:
    planes = planes_forward(np.arange(64, dtype=np.uint8), 4)
    for out in (np.full(60, 9, dtype=np.uint8), np.full(16, 9, dtype=np.uint32),
                np.full((8, 8), 9, dtype=np.uint8), np.full(128, 9, dtype=np.uint8)[::2]):
        with pytest.raises(ValueError, match="cannot fill"):
            planes_inverse(planes, 4, out)
        assert (out == 9).all()


def test_the_default_inverse_into_copies_and_checks_the_length() -> None:
    xor = transform("xorbase/1")  # undone by the restore pipeline: the identity at chunk level
    data = np.arange(32, dtype=np.uint8)
    out = np.zeros(32, dtype=np.uint8)
    assert xor.inverse_into(data, {}, out) is out and out.tolist() == data.tolist()
    short = np.full(31, 5, dtype=np.uint8)
    with pytest.raises(ValueError, match="cannot fill"):
        xor.inverse_into(data, {}, short)
    assert (short == 5).all()


def encoded(chain: str, raw: np.ndarray) -> tuple[ChunkRecord, list[dict[str, Any]], np.ndarray]:
    """One chunk of ``raw`` stored through ``chain`` ("planes+zstd", "zstd", "lz4", "none")."""
    if chain == "planes+zstd":
        stages: list[dict[str, Any]] = [{"name": "byteplanes/1", "width": 4}, {"name": "zstd/1"}]
        body = ZstdCodec(1).encode(planes_forward(raw, 4))
    elif chain == "none":
        stages, body = [{"name": "none/1"}], raw.tobytes()
    else:
        codec = host_codec(chain)
        stages, body = [{"name": codec.name}], codec.encode(raw)
    stored = np.frombuffer(bytes(body), dtype=np.uint8)
    return ChunkRecord(4096, stored.size, raw.size, checksum(stored), 0), stages, stored


@pytest.mark.parametrize("chain", ["planes+zstd", "zstd", "lz4", "none"])
def test_a_chunk_decoded_into_a_destination_holds_the_same_bytes(chain: str) -> None:
    raw = (np.random.default_rng(1).standard_normal(8192) * 0.02).astype(np.float32).view(np.uint8)
    record, stages, stored = encoded(chain, raw)
    out = np.zeros(raw.size, dtype=np.uint8)
    assert decode_host_chunk(record, stages, stored, host_codec, out=out) is out
    assert out.tobytes() == raw.tobytes() == decode_host_chunk(record, stages, stored, host_codec).tobytes()


@pytest.mark.parametrize("chain", ["planes+zstd", "zstd"])
def test_a_chunk_that_fails_its_checks_leaves_its_destination_as_it_was(chain: str) -> None:
    raw = (np.random.default_rng(2).standard_normal(8192) * 0.02).astype(np.float32).view(np.uint8)
    record, stages, stored = encoded(chain, raw)
    flipped = stored.copy()
    flipped[len(flipped) // 2] ^= 0x20
    out = np.full(raw.size, 0xAB, dtype=np.uint8)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        decode_host_chunk(record, stages, flipped, host_codec, out=out)
    # a stream that matches its checksum but does not decode (as a faulty writer would store it)
    garbled = np.frombuffer(b"\x28\xb5\x2f\xfd" + bytes(60), dtype=np.uint8)
    bad = ChunkRecord(4096, garbled.size, raw.size, checksum(garbled), 0)
    with pytest.raises(CorruptCheckpointError, match="does not decode"):
        decode_host_chunk(bad, stages, garbled, host_codec, out=out)
    assert (out == 0xAB).all()


class RecordingEngine(HostEngine):
    """The CPU engine, noting which chunks were handed a whole destination to decode into."""

    def __init__(self) -> None:
        super().__init__([], codec="none", byte_planes="never", threads=2)
        self.into: dict[int, bool] = {}

    def submit_decode(self, record: ChunkRecord, chain: list[dict[str, Any]], stored: Any, deliver: Any, *,
                      to_host: bool = False, places: Any = None, into: Any = None) -> Future[None]:
        self.into[record.offset] = into is not None
        return super().submit_decode(record, chain, stored, deliver, to_host=to_host, places=places, into=into)


def test_a_restore_decodes_whole_chunks_into_their_destinations_and_shared_ones_through_copies(
        tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    state = {"big": (rng.standard_normal(1 << 21) * 0.02).astype(np.float32),  # 8 MiB: whole chunks
             "small.a": rng.standard_normal(100).astype(np.float32),  # packed together in one chunk
             "small.b": rng.standard_normal(50).astype(np.float32)}
    path = tmp_path / "x.gdsckpt"
    gdsckpt.save(state, path, codec="zstd", config=gdsckpt.Config(chunk_bytes=1 << 20))
    with PosixReader(path) as reader:
        index = open_file(reader).index
        keys = [record.key for record in index.tensors]
        targets = {i: NumpyTarget(state[key].shape, "float32") for i, key in enumerate(keys)}
        engine = RecordingEngine()
        try:
            run_restore(reader, index, engine, targets, max_inflight_bytes=64 << 20)
        finally:
            engine.close()
    for i, key in enumerate(keys):
        assert targets[i].finish().tobytes() == state[key].tobytes(), key
    big = keys.index("big")
    whole = {index.chunks[s.chunk].offset for s in index.tensors[big].segments}
    packed = {index.chunks[s.chunk].offset for i, key in enumerate(keys) if key != "big"
              for s in index.tensors[i].segments}
    assert len(whole) == 8 and all(engine.into[offset] for offset in whole)
    assert packed and not any(engine.into[offset] for offset in packed)


def test_tensors_sharing_memory_are_not_decoded_into(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    a, b = torch.randn(1 << 20), torch.randn(1 << 20)
    path = tmp_path / "tied.gdsckpt"
    gdsckpt.save({"a": a, "b": b}, path, codec="zstd", config=gdsckpt.Config(chunk_bytes=1 << 20))
    shared = torch.zeros(1 << 20)
    target = {"a": shared, "b": shared}  # tied: the last key wins, as with load_state_dict
    gdsckpt.load_into(target, path)
    assert torch.equal(shared, b)
