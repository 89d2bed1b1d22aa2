"""Codecs: the bitstreams are the standard ones (readable by and from the reference libraries),
byte planes pay off on trained-weight-like data, and codec names are checked."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import lz4.block
import numpy as np
import pytest
import torch
import zstandard

import gdsckpt
from gdsckpt.codecs import BYTE_PLANES, PORTABLE_CODECS, host_codec, known_codec_names
from gdsckpt.errors import CorruptCheckpointError
from gdsckpt.format.index import ChunkRecord
from gdsckpt.pipeline.engine import decode_host_chunk


def _samples() -> list[Any]:
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal(20000) * 0.02).astype(np.float32).view(np.uint8)
    return [
        pytest.param(np.zeros(0, dtype=np.uint8), id="empty"),
        pytest.param(np.frombuffer(b"a", dtype=np.uint8), id="one-byte"),
        pytest.param(np.frombuffer(b"hello gdsckpt " * 500, dtype=np.uint8), id="text"),
        pytest.param(rng.integers(0, 256, 5000, dtype=np.uint8), id="random"),
        pytest.param(weights, id="weights"),
        pytest.param(np.zeros(1 << 20, dtype=np.uint8), id="zeros-1MiB"),
    ]


def _reference_decode(name: str, stream: bytes, raw_length: int) -> bytes:
    if name == "zstd":
        return zstandard.ZstdDecompressor().decompress(stream, max_output_size=max(raw_length, 1))
    if name == "lz4":
        return lz4.block.decompress(stream, uncompressed_size=raw_length) if raw_length else b""
    return zlib.decompress(stream, wbits=-15)


def _reference_encodings(name: str, data: bytes) -> list[bytes]:
    if name == "zstd":
        return [zstandard.ZstdCompressor(level=level, write_content_size=size).compress(data)
                for level in (1, 3, 19) for size in (True, False)]
    if name == "lz4":
        return [lz4.block.compress(data, store_size=False),
                lz4.block.compress(data, store_size=False, mode="high_compression", compression=12)]
    streams = []
    for level in (0, 1, 6, 9):
        compressor = zlib.compressobj(level, zlib.DEFLATED, -15)
        streams.append(compressor.compress(data) + compressor.flush())
    return streams


@pytest.mark.parametrize("data", _samples())
@pytest.mark.parametrize("name", ["zstd", "lz4", "deflate"])
def test_our_streams_decode_with_the_reference_library(name: str, data: np.ndarray) -> None:
    stream = bytes(host_codec(name).encode(data))
    assert _reference_decode(name, stream, data.nbytes) == data.tobytes()


@pytest.mark.parametrize("data", _samples())
@pytest.mark.parametrize("name", ["zstd", "lz4", "deflate"])
def test_reference_streams_decode_with_our_codec(name: str, data: np.ndarray) -> None:
    codec = host_codec(name)
    for stream in _reference_encodings(name, data.tobytes()):
        assert bytes(codec.decode(stream, data.nbytes)) == data.tobytes()


def test_versioned_names() -> None:
    assert {host_codec(n).name for n in PORTABLE_CODECS} == {"zstd/1", "lz4/1", "deflate/1", "none/1"}
    assert set(PORTABLE_CODECS) == {"zstd", "lz4", "deflate", "none"}
    assert {"auto", "zstd", "lz4", "deflate", "none", "ans"} <= set(known_codec_names())


@pytest.mark.parametrize("codec", ["zstd", "lz4", "deflate"])
def test_chunks_in_a_file_are_standard_streams(codec: str, ckpt_path: Path, h: Any) -> None:
    """Read each chunk's stored bytes straight from the file and decode them with the reference
    library: the result is the tensor's bytes (chains without byte planes)."""
    values = (torch.arange(6000) % 50).to(torch.float32)
    gdsckpt.save({"w": values}, ckpt_path, codec=codec, config=h.small_config(byte_planes="never"))
    index = h.read_index(ckpt_path)
    data = ckpt_path.read_bytes()
    pieces = []
    for segment in index.tensors[0].segments:
        chunk = index.chunks[segment.chunk]
        chain = index.chains[chunk.chain]
        stored = data[chunk.offset:chunk.offset + chunk.stored]
        if chain == [{"name": "none/1"}]:
            raw = stored
        else:
            assert chain == [{"name": f"{codec}/1"}]
            raw = _reference_decode(codec, stored, chunk.raw)
        pieces.append(raw[segment.raw_offset:segment.raw_offset + segment.length])
    assert any(index.chains[c.chain] != [{"name": "none/1"}] for c in index.chunks)
    assert b"".join(pieces) == h.tensor_bytes(values)


def test_byte_planes_chunks_in_a_file_are_documented_layout(ckpt_path: Path, h: Any) -> None:
    """byteplanes/1 + zstd/1: zstd-decode, then plane k holds byte (width-1-k) of every element."""
    values = (torch.randn(3000, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.float32)
    gdsckpt.save({"w": values}, ckpt_path, codec="zstd", config=h.small_config(byte_planes="always"))
    index = h.read_index(ckpt_path)
    data = ckpt_path.read_bytes()
    raw_bytes = np.frombuffer(h.tensor_bytes(values), dtype=np.uint8).reshape(-1, 4)
    position = 0
    for segment in index.tensors[0].segments:
        chunk = index.chunks[segment.chunk]
        assert index.chains[chunk.chain] == [{"name": "byteplanes/1", "width": 4}, {"name": "zstd/1"}]
        planes = zstandard.ZstdDecompressor().decompress(data[chunk.offset:chunk.offset + chunk.stored])
        elements = raw_bytes[position // 4:(position + segment.length) // 4]
        expected = b"".join(elements[:, 3 - k].tobytes() for k in range(4))
        assert planes == expected
        position += segment.length


@pytest.mark.parametrize("width", [2, 4, 8])
def test_byte_planes_transform_inverts(width: int) -> None:
    data = np.random.default_rng(width).integers(0, 256, width * 1000, dtype=np.uint8)
    params = {"width": width}
    planes = BYTE_PLANES.forward(data, params)
    assert planes.nbytes == data.nbytes and not np.array_equal(planes, data)
    assert np.array_equal(planes[:1000], data[width - 1::width])  # most significant bytes first
    assert np.array_equal(BYTE_PLANES.inverse(planes, params), data)
    with pytest.raises(ValueError):
        BYTE_PLANES.forward(data[:-1], params)
    with pytest.raises(ValueError):
        BYTE_PLANES.forward(data, {"width": 3})


def _planes_by_definition(data: np.ndarray, width: int) -> np.ndarray:
    """Byte planes spelled out: every element's most significant byte, then the next, ..."""
    elements = data.reshape(-1, width)
    return np.concatenate([elements[:, width - 1 - k] for k in range(width)])


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("count", [0, 1, 3, 999, 4097, (1 << 20) // 2 + 7, (1 << 20) + 1])
@pytest.mark.parametrize("offset", [0, 1])
def test_word_wise_byte_planes_match_the_definition(width: int, count: int, offset: int) -> None:
    """The word-wise forward and inverse give exactly the bytes of the simple definition, for odd
    element counts, counts across the block size, and misaligned input."""
    from gdsckpt.codecs.cpu import (
        planes_forward,
        planes_forward_reference,
        planes_inverse,
        planes_inverse_reference,
    )

    buffer = np.random.default_rng(count * 10 + width).integers(0, 256, width * count + 1, dtype=np.uint8)
    data = buffer[offset:offset + width * count]
    expected = _planes_by_definition(data, width)
    params = {"width": width}
    assert np.array_equal(planes_forward_reference(data, width), expected)
    assert np.array_equal(planes_forward(data, width), expected)
    assert np.array_equal(BYTE_PLANES.forward(data, params), expected)
    planes = buffer[offset:offset + width * count]  # arbitrary bytes as planes, misaligned too
    data_back = _planes_by_definition(planes_inverse_reference(planes, width), width)
    assert np.array_equal(data_back, planes)
    assert np.array_equal(planes_inverse(planes, width), planes_inverse_reference(planes, width))
    assert np.array_equal(BYTE_PLANES.inverse(expected, params), data)
    for bad in (3, None, "4"):
        with pytest.raises(ValueError):
            planes_forward(data, bad)
        with pytest.raises(ValueError):
            planes_inverse(data, bad)
    if count:
        with pytest.raises(ValueError):
            planes_forward(data[:-1], width)
        with pytest.raises(ValueError):
            planes_inverse(data[:-1], width)


def _normal_state(dtype: torch.dtype, mib: int) -> dict[str, Any]:
    count = mib * (1 << 20) // torch.empty((), dtype=dtype).element_size()
    values = torch.randn(count, generator=torch.Generator().manual_seed(7)) * 0.02
    return {"weights": values.to(dtype)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_byte_planes_beat_plain_zstd_on_normal_weights(dtype: torch.dtype, tmp_path: Path, h: Any) -> None:
    state = _normal_state(dtype, mib=3)
    reports = {}
    for planes in ("always", "never", "auto"):
        reports[planes] = gdsckpt.save(state, tmp_path / f"{planes}.gdsckpt", codec="zstd",
                                       config=h.small_config(chunk_bytes="1MiB", byte_planes=planes))
        h.assert_same(state, gdsckpt.load(tmp_path / f"{planes}.gdsckpt"))
    ratio_planes, ratio_plain = reports["always"].ratio, reports["never"].ratio
    assert ratio_plain > 1.0 and ratio_planes > ratio_plain, (ratio_planes, ratio_plain)
    assert set(reports["always"].chains) == {"byteplanes/1+zstd/1"}
    assert set(reports["never"].chains) == {"zstd/1"}
    # "auto" sees the same gain and takes byte planes.
    assert set(reports["auto"].chains) == {"byteplanes/1+zstd/1"}
    assert reports["auto"].ratio == pytest.approx(ratio_planes)


def test_incompressible_chunks_are_stored_raw(ckpt_path: Path, h: Any) -> None:
    noise = torch.from_numpy(np.random.default_rng(1).integers(0, 256, 20000, dtype=np.uint8))
    report = gdsckpt.save({"noise": noise}, ckpt_path, codec="zstd", config=h.small_config())
    assert set(report.chains) == {"none/1"}
    assert report.file_bytes < noise.numel() + 4096 * 2 + 2048
    h.assert_same({"noise": noise}, gdsckpt.load(ckpt_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's answer")
@pytest.mark.parametrize("name", ["ans", "gdeflate", "bitcomp"])
def test_gpu_only_codec_on_cpu_raises_codec_unavailable(name: str, ckpt_path: Path, h: Any) -> None:
    with pytest.raises(gdsckpt.CodecUnavailableError) as caught:
        gdsckpt.save({"w": torch.ones(10)}, ckpt_path, codec=name, config=h.small_config())
    message = str(caught.value)
    assert name in message
    for portable in ("zstd", "lz4", "deflate", "none"):
        assert portable in message
    assert not ckpt_path.exists() and list(ckpt_path.parent.iterdir()) == []


@pytest.mark.parametrize("name", ["brotli", "ZSTD", "zstd/1", ""])
def test_unknown_codec_raises_value_error_listing_choices(name: str, ckpt_path: Path, h: Any) -> None:
    with pytest.raises(ValueError) as caught:
        gdsckpt.save({"w": torch.ones(10)}, ckpt_path, codec=name, config=h.small_config())
    message = str(caught.value)
    assert repr(name) in message
    for choice in ("auto", "zstd", "lz4", "deflate", "none"):
        assert choice in message
    assert not isinstance(caught.value, gdsckpt.CheckpointError)
    assert not ckpt_path.exists()
    with pytest.raises(ValueError, match="brotli"):
        gdsckpt.save({"w": torch.ones(10)}, ckpt_path, config=h.small_config(codec="brotli"))


@pytest.mark.parametrize("stage", [{"name": "nvcomp.ans/1"},
                                   {"data_type": "<f4", "delta": 0.25, "name": "nvcomp.bitcomp-lossy/1"}])
def test_file_naming_a_gpu_only_codec_cannot_be_decoded_on_cpu(stage: dict[str, Any], ckpt_path: Path,
                                                                h: Any) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only machine's answer")
    gdsckpt.save({"w": torch.arange(3000.0)}, ckpt_path, codec="zstd", config=h.small_config())

    def edit(doc: dict[str, Any]) -> None:
        doc["chains"] = [[stage] if chain[-1]["name"] == "zstd/1" else chain for chain in doc["chains"]]

    h.rewrite_index(ckpt_path, edit)
    assert stage["name"] in gdsckpt.inspect(ckpt_path).codecs
    assert not gdsckpt.inspect(ckpt_path).portable
    for operation in (gdsckpt.load, gdsckpt.verify):
        with pytest.raises(gdsckpt.CodecUnavailableError, match="zstd, lz4, deflate, none") as caught:
            operation(ckpt_path)
        assert "gdsckpt convert FILE COPY.gdsckpt --codec zstd" in str(caught.value)


def test_file_naming_an_unknown_codec_is_unsupported(ckpt_path: Path, h: Any) -> None:
    gdsckpt.save({"w": torch.arange(3000.0)}, ckpt_path, codec="zstd", config=h.small_config())

    def edit(doc: dict[str, Any]) -> None:
        doc["chains"] = [[{"name": "future-codec/1"}] for _ in doc["chains"]]

    h.rewrite_index(ckpt_path, edit)
    with pytest.raises(gdsckpt.UnsupportedFormatError, match="future-codec/1"):
        gdsckpt.load(ckpt_path)


@pytest.mark.parametrize("name", ["zstd", "lz4", "deflate", "none"])
def test_undecodable_stream_is_corrupt(name: str) -> None:
    """A stream whose checksum matches but which does not decode to the recorded length."""
    data = np.frombuffer(b"0123456789abcdef" * 256, dtype=np.uint8)
    stream = np.frombuffer(bytes(host_codec(name).encode(data)), dtype=np.uint8)
    candidates = [stream[: len(stream) // 2], np.full(64, 0xFF, dtype=np.uint8)]
    for body in candidates:
        record = ChunkRecord(4096, body.nbytes, data.nbytes, gdsckpt.format.checksum(body), 0)
        with pytest.raises(CorruptCheckpointError):
            decode_host_chunk(record, [{"name": f"{name}/1"}], body, host_codec)
    good = ChunkRecord(4096, stream.nbytes, data.nbytes, gdsckpt.format.checksum(stream), 0)
    assert bytes(decode_host_chunk(good, [{"name": f"{name}/1"}], stream, host_codec)) == data.tobytes()
    wrong_length = ChunkRecord(4096, stream.nbytes, data.nbytes + 16, gdsckpt.format.checksum(stream), 0)
    with pytest.raises(CorruptCheckpointError):
        decode_host_chunk(wrong_length, [{"name": f"{name}/1"}], stream, host_codec)


def test_compression_level_is_applied(tmp_path: Path, h: Any) -> None:
    rng = np.random.default_rng(0)
    words = b" ".join(rng.choice([b"alpha", b"beta", b"gamma", b"delta", b"epsilon"], 150000))
    state = {"text": torch.frombuffer(bytearray(words), dtype=torch.uint8)}
    config = h.small_config(chunk_bytes="1MiB", pack_below=0)
    sizes = {}
    for level in (1, 19):
        path = tmp_path / f"level{level}.gdsckpt"
        sizes[level] = gdsckpt.save(state, path, codec="zstd", config=config.replace(level=level)).file_bytes
        h.assert_same(state, gdsckpt.load(path))
    assert sizes[19] < sizes[1] * 0.8, sizes


def test_bitcomp_lossy_is_a_bitstream_not_a_codec_choice(ckpt_path: Path, h: Any) -> None:
    """The GPU engine writes ``nvcomp.bitcomp-lossy/1`` for rounded arrays; no user picks it."""
    assert "bitcomp-lossy" not in known_codec_names() and "bitcomp" in known_codec_names()
    with pytest.raises(ValueError, match="bitcomp-lossy"):
        gdsckpt.save({"w": torch.ones(10)}, ckpt_path, codec="bitcomp-lossy", config=h.small_config())
    with pytest.raises(gdsckpt.CodecUnavailableError, match="nvcomp.bitcomp-lossy/1"):
        host_codec("nvcomp.bitcomp-lossy/1")


@pytest.mark.parametrize("stage, problem", [
    ({"data_type": "<f4"}, "delta"),
    ({"data_type": "<f4", "delta": True}, "delta"),
    ({"data_type": "<f4", "delta": 0}, "delta"),
    ({"data_type": "<f4", "delta": -0.5}, "delta"),
    ({"data_type": "<f4", "delta": float("inf")}, "delta"),
    ({"data_type": "<f4", "delta": float("nan")}, "delta"),
    ({"data_type": "<f4", "delta": [0.5]}, "delta"),
    ({"data_type": "<f8", "delta": 0.5}, "data_type"),
    ({"data_type": ["<f4"], "delta": 0.5}, "data_type"),
    ({"delta": 0.5}, "data_type"),
])
def test_bitcomp_lossy_stage_parameters_are_checked(stage: dict[str, Any], problem: str) -> None:
    """A Bitcomp lossy stage decodes only with the encoder's data type and delta, read from the
    file: anything but "<f4"/"<f2" and a finite positive number is refused (the GPU reader turns
    that into CorruptCheckpointError), and ill-typed parameters never reach a dict key."""
    from gdsckpt.codecs.nvcomp import bitcomp_lossy_params, decoder_key

    stage = {"name": "nvcomp.bitcomp-lossy/1", **stage}
    with pytest.raises(ValueError, match=problem):
        bitcomp_lossy_params(stage)
    with pytest.raises(ValueError, match=problem):
        decoder_key(stage)


def test_decoder_keys_of_valid_stages() -> None:
    from gdsckpt.codecs.nvcomp import decoder_key

    assert decoder_key({"name": "nvcomp.bitcomp-lossy/1", "data_type": "<f2", "delta": 1}) == \
        ("nvcomp.bitcomp-lossy/1", "<f2", 1.0)
    assert decoder_key({"name": "nvcomp.ans/1", "data_type": "<f4"}) == ("nvcomp.ans/1", "<f4", None)
    assert decoder_key({"name": "zstd/1"}) == ("zstd/1", None, None)
    with pytest.raises(ValueError, match="data_type"):
        decoder_key({"name": "nvcomp.ans/1", "data_type": {"x": 1}})
