"""Damaged and foreign files: every kind of damage raises the right error, naming the tensor and
chunk where it can."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import gdsckpt
from gdsckpt.format import checksum

CODECS = ["zstd", "lz4", "deflate", "none"]


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "layers": {"w1": torch.randn(3000, generator=g),    # chunks 0-2
                   "w2": torch.randn(2000, generator=g)},   # chunks 3-4
        "small": [torch.ones(10), torch.arange(5.0)],        # one packed chunk
        "step": 3,
    }


@pytest.fixture(params=CODECS)
def good_file(request: Any, ckpt_path: Path, h: Any) -> tuple[Path, bytes, Any]:
    gdsckpt.save(_state(), ckpt_path, codec=request.param, config=h.small_config())
    return ckpt_path, ckpt_path.read_bytes(), h.read_index(ckpt_path)


def _owner(index: Any, chunk: int) -> str:
    return next(t.key for t in index.tensors if any(s.chunk == chunk for s in t.segments))


def _flip(data: bytes, offset: int, mask: int = 0x01) -> bytes:
    out = bytearray(data)
    out[offset] ^= mask
    return bytes(out)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_chunk_byte_names_tensor_and_chunk(good_file: Any, where: str, tmp_path: Path) -> None:
    _path, data, index = good_file
    assert len(index.chunks) >= 6
    for number in (1, 4, len(index.chunks) - 1):
        chunk = index.chunks[number]
        offset = {"first": chunk.offset, "middle": chunk.offset + chunk.stored // 2,
                  "last": chunk.offset + chunk.stored - 1}[where]
        bad = tmp_path / f"bad{number}.gdsckpt"
        bad.write_bytes(_flip(data, offset))
        key = _owner(index, number)
        pattern = rf"{key}.*chunk {number}\b"
        for operation in (gdsckpt.load, gdsckpt.verify):
            with pytest.raises(gdsckpt.CorruptCheckpointError, match=pattern) as caught:
                operation(bad)
            assert caught.value.key == key and caught.value.chunk == number
        # The damage is local: other tensors still load from the damaged file.
        others = [t.key for t in index.tensors if t.key != key and t.segments
                  and all(s.chunk != number for s in t.segments)]
        assert others
        gdsckpt.load(bad, keys=others)
        with pytest.raises(gdsckpt.CorruptCheckpointError, match=rf"chunk {number}\b"):
            gdsckpt.load(bad, keys=[key])
        # Opening and describing the file needs no chunk.
        assert gdsckpt.inspect(bad).tensors


def test_damage_in_a_packed_chunk_names_one_of_its_tensors(ckpt_path: Path, h: Any) -> None:
    gdsckpt.save(_state(), ckpt_path, codec="zstd", config=h.small_config())
    index = h.read_index(ckpt_path)
    packed = index.tensors[2].segments[0].chunk
    assert index.tensors[3].segments[0].chunk == packed, "small tensors share one chunk"
    chunk = index.chunks[packed]
    ckpt_path.write_bytes(_flip(ckpt_path.read_bytes(), chunk.offset + 3))
    with pytest.raises(gdsckpt.CorruptCheckpointError) as caught:
        gdsckpt.verify(ckpt_path)
    assert caught.value.chunk == packed and caught.value.key in ("small/0", "small/1")
    assert f"chunk {packed}" in str(caught.value) and caught.value.key in str(caught.value)


def test_corrupt_stream_with_matching_checksum_is_reported(ckpt_path: Path, h: Any) -> None:
    """A chunk whose bytes match the index's checksum but do not decode: still corrupt, still named."""
    gdsckpt.save(_state(), ckpt_path, codec="zstd", config=h.small_config(byte_planes="never"))
    index = h.read_index(ckpt_path)
    chunk = index.chunks[1]
    data = bytearray(ckpt_path.read_bytes())
    data[chunk.offset:chunk.offset + chunk.stored] = b"\x00" * chunk.stored
    ckpt_path.write_bytes(bytes(data))
    new_crc = checksum(bytes(chunk.stored))

    def edit(doc: dict[str, Any]) -> None:
        doc["chunks"][1][3] = new_crc

    h.rewrite_index(ckpt_path, edit)
    for operation in (gdsckpt.load, gdsckpt.verify):
        with pytest.raises(gdsckpt.CorruptCheckpointError, match=r"layers/w1.*chunk 1\b") as caught:
            operation(ckpt_path)
        assert caught.value.chunk == 1 and caught.value.key == "layers/w1"


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.3, 0.5, 0.9, 0.999])
def test_truncated_file_is_corrupt(fraction: float, ckpt_path: Path, h: Any) -> None:
    gdsckpt.save(_state(), ckpt_path, config=h.small_config())
    data = ckpt_path.read_bytes()
    length = max(8, int(len(data) * fraction))  # at least the magic number survives
    ckpt_path.write_bytes(data[:length])
    for operation in (gdsckpt.load, gdsckpt.verify, gdsckpt.inspect, gdsckpt.open):
        with pytest.raises(gdsckpt.CorruptCheckpointError, match="truncated|runs past|not fully written"):
            operation(ckpt_path)


@pytest.mark.parametrize("cut", [1, 63, 64, 65, 4096])
def test_file_missing_its_last_bytes_is_corrupt(cut: int, ckpt_path: Path, h: Any) -> None:
    gdsckpt.save(_state(), ckpt_path, config=h.small_config())
    ckpt_path.write_bytes(ckpt_path.read_bytes()[:-cut])
    with pytest.raises(gdsckpt.CorruptCheckpointError, match="truncated"):
        gdsckpt.load(ckpt_path)


def test_appended_bytes_are_corrupt(ckpt_path: Path, h: Any) -> None:
    gdsckpt.save(_state(), ckpt_path, config=h.small_config())
    ckpt_path.write_bytes(ckpt_path.read_bytes() + b"\x00" * 100)
    # the message names appended bytes as a cause, not only truncation
    with pytest.raises(gdsckpt.CorruptCheckpointError, match="followed by other bytes"):
        gdsckpt.load(ckpt_path)


@pytest.mark.parametrize("content", [
    pytest.param(None, id="wrong-first-byte"),
    pytest.param(b"PK\x03\x04" + bytes(10000), id="zip"),
    pytest.param(b'{"format": "gdsckpt"}' * 300, id="json"),
    pytest.param(b"x" * 20, id="short-text"),
])
def test_wrong_magic_is_unsupported_format(content: bytes | None, ckpt_path: Path, h: Any) -> None:
    gdsckpt.save(_state(), ckpt_path, config=h.small_config())
    data = ckpt_path.read_bytes()
    ckpt_path.write_bytes(_flip(data, 0, 0xFF) if content is None else content)
    for operation in (gdsckpt.load, gdsckpt.verify, gdsckpt.inspect, gdsckpt.open):
        with pytest.raises(gdsckpt.UnsupportedFormatError, match="not a gdsckpt checkpoint"):
            operation(ckpt_path)


def test_torch_save_file_is_unsupported_format(ckpt_path: Path) -> None:
    torch.save({"w": torch.ones(1000)}, ckpt_path)
    with pytest.raises(gdsckpt.UnsupportedFormatError):
        gdsckpt.load(ckpt_path)


def _with_header(data: bytes, offset: int, value: bytes) -> bytes:
    out = bytearray(data)
    out[offset:offset + len(value)] = value
    out[60:64] = struct.pack("<I", checksum(bytes(out[:60])))
    return bytes(out)


def _with_trailer(data: bytes, offset: int, value: bytes) -> bytes:
    out = bytearray(data)
    start = len(out) - 64
    out[start + offset:start + offset + len(value)] = value
    out[start + 60:start + 64] = struct.pack("<I", checksum(bytes(out[start:start + 60])))
    return bytes(out)


@pytest.mark.parametrize("major", [0, 2, 255, 65535])
def test_other_major_version_in_header_is_unsupported(major: int, ckpt_path: Path, h: Any) -> None:
    gdsckpt.save(_state(), ckpt_path, config=h.small_config())
    ckpt_path.write_bytes(_with_header(ckpt_path.read_bytes(), 8, struct.pack("<H", major)))
    for operation in (gdsckpt.load, gdsckpt.verify, gdsckpt.inspect):
        with pytest.raises(gdsckpt.UnsupportedFormatError, match=rf"version {major}\.0 .*upgrade"):
            operation(ckpt_path)


@pytest.mark.parametrize("major", [0, 2, 7])
def test_other_major_version_in_trailer_is_unsupported(major: int, ckpt_path: Path, h: Any) -> None:
    gdsckpt.save(_state(), ckpt_path, config=h.small_config())
    ckpt_path.write_bytes(_with_trailer(ckpt_path.read_bytes(), 8, struct.pack("<H", major)))
    for operation in (gdsckpt.load, gdsckpt.verify, gdsckpt.inspect):
        with pytest.raises(gdsckpt.UnsupportedFormatError, match=rf"version {major}\.0 .*upgrade"):
            operation(ckpt_path)


def test_other_major_version_in_index_is_unsupported(ckpt_path: Path, h: Any) -> None:
    gdsckpt.save(_state(), ckpt_path, config=h.small_config())

    def edit(doc: dict[str, Any]) -> None:
        doc["version"] = [2, 0]

    h.rewrite_index(ckpt_path, edit)
    with pytest.raises(gdsckpt.UnsupportedFormatError, match="2.0"):
        gdsckpt.load(ckpt_path)


def test_newer_minor_version_is_still_read(ckpt_path: Path, h: Any) -> None:
    state = _state()
    gdsckpt.save(state, ckpt_path, config=h.small_config())
    data = _with_header(ckpt_path.read_bytes(), 10, struct.pack("<H", 9))
    ckpt_path.write_bytes(_with_trailer(data, 10, struct.pack("<H", 9)))
    h.assert_same(state, gdsckpt.load(ckpt_path))


def test_version_patch_without_checksum_fix_is_still_detected(ckpt_path: Path, h: Any) -> None:
    """Guard for the tests above: a header byte changed without fixing its CRC is corrupt."""
    gdsckpt.save(_state(), ckpt_path, config=h.small_config())
    data = bytearray(ckpt_path.read_bytes())
    data[40] ^= 0x10  # a reserved byte: only the CRC notices
    ckpt_path.write_bytes(bytes(data))
    with pytest.raises(gdsckpt.CorruptCheckpointError, match="header checksum"):
        gdsckpt.load(ckpt_path)


def _index_span(path: Path) -> tuple[int, int]:
    from gdsckpt.format import unpack_trailer

    data = path.read_bytes()
    trailer = unpack_trailer(data[-64:], len(data))
    return trailer.index_offset, trailer.index_length


@pytest.mark.parametrize("position", [0, 0.25, 0.5, 0.75, 1])
def test_corrupted_index_byte_is_corrupt(position: float, ckpt_path: Path, h: Any) -> None:
    gdsckpt.save(_state(), ckpt_path, config=h.small_config())
    offset, length = _index_span(ckpt_path)
    where = offset + min(length - 1, int(length * position))
    ckpt_path.write_bytes(_flip(ckpt_path.read_bytes(), where, 0x20))
    for operation in (gdsckpt.load, gdsckpt.verify, gdsckpt.inspect, gdsckpt.open):
        with pytest.raises(gdsckpt.CorruptCheckpointError, match="index checksum"):
            operation(ckpt_path)


@pytest.mark.parametrize("offset", [0, 12, 16, 24, 32, 40, 60])
def test_corrupted_trailer_byte_is_corrupt(offset: int, ckpt_path: Path, h: Any) -> None:
    gdsckpt.save(_state(), ckpt_path, config=h.small_config())
    data = ckpt_path.read_bytes()
    ckpt_path.write_bytes(_flip(data, len(data) - 64 + offset, 0x04))
    with pytest.raises(gdsckpt.CorruptCheckpointError):
        gdsckpt.load(ckpt_path)


def _edits() -> list[Any]:
    def chunk_overlaps(doc: dict[str, Any]) -> None:
        doc["chunks"][1][0] = doc["chunks"][0][0]

    def chunk_past_index(doc: dict[str, Any]) -> None:
        doc["chunks"][-1][1] = 10**9

    def segment_too_long(doc: dict[str, Any]) -> None:
        doc["tensors"][0]["segments"][0][2] += 4

    def shape_disagrees(doc: dict[str, Any]) -> None:
        doc["tensors"][0]["shape"] = [3001]

    def unknown_dtype(doc: dict[str, Any]) -> None:
        doc["tensors"][0]["dtype"] = "float128"

    def tree_drops_tensor(doc: dict[str, Any]) -> None:
        doc["tree"] = {"t": "none"}

    def not_json(doc: dict[str, Any]) -> None:
        doc.clear()

    return [pytest.param(f, id=f.__name__) for f in
            (chunk_overlaps, chunk_past_index, segment_too_long, shape_disagrees, unknown_dtype,
             tree_drops_tensor, not_json)]


@pytest.mark.parametrize("edit", _edits())
def test_inconsistent_index_is_corrupt(edit: Any, ckpt_path: Path, h: Any) -> None:
    """An index with a valid checksum that contradicts itself or the file is rejected on open."""
    gdsckpt.save(_state(), ckpt_path, config=h.small_config())
    h.rewrite_index(ckpt_path, edit)
    for operation in (gdsckpt.load, gdsckpt.verify, gdsckpt.inspect):
        with pytest.raises(gdsckpt.CorruptCheckpointError, match="invalid index"):
            operation(ckpt_path)


def test_rewrite_index_helper_keeps_a_good_file_good(ckpt_path: Path, h: Any) -> None:
    """Guard for the tests above: rewriting the index unchanged leaves a loadable file."""
    state = _state()
    gdsckpt.save(state, ckpt_path, config=h.small_config())
    h.rewrite_index(ckpt_path, lambda doc: None)
    h.assert_same(state, gdsckpt.load(ckpt_path))
    assert json.loads(ckpt_path.read_bytes()[_index_span(ckpt_path)[0]:-64])["format"] == "gdsckpt"


def test_error_classes() -> None:
    for cls in (gdsckpt.CorruptCheckpointError, gdsckpt.UnsupportedFormatError, gdsckpt.CodecUnavailableError,
                gdsckpt.StateMismatchError):
        assert issubclass(cls, gdsckpt.CheckpointError)
    err = gdsckpt.CorruptCheckpointError("chunk checksum mismatch", key="a/b", chunk=4)
    assert (err.key, err.chunk, err.reason) == ("a/b", 4, "chunk checksum mismatch")
    assert "a/b" in str(err) and "chunk 4" in str(err)


def test_every_public_exception_is_in_errors_and_under_checkpoint_error() -> None:
    """One exception tree (issue 17): every error the package exports is defined in
    ``gdsckpt.errors`` and is a ``CheckpointError``; errors that are also misuse or runtime
    failures keep their built-in base; every warning is defined there too."""
    import gdsckpt.errors

    exported = [getattr(gdsckpt, name) for name in gdsckpt.__all__]
    classes = [obj for obj in exported if isinstance(obj, type) and issubclass(obj, BaseException)]
    errors = [cls for cls in classes if not issubclass(cls, Warning)]
    assert len(errors) >= 10 and len(classes) > len(errors)
    for cls in classes:
        assert cls.__module__ == "gdsckpt.errors", f"{cls.__name__} is defined in {cls.__module__}"
    for cls in errors:
        assert issubclass(cls, gdsckpt.CheckpointError), cls
    assert issubclass(gdsckpt.SaveWorkerError, RuntimeError)
    assert issubclass(gdsckpt.InsufficientSpaceError, ValueError)
    assert issubclass(gdsckpt.StateMismatchError, ValueError)
    assert gdsckpt.errors.BaseCheckpointError is gdsckpt.DeltaBaseError is gdsckpt.BaseCheckpointError


def test_former_import_paths_of_moved_exceptions_still_work() -> None:
    from gdsckpt.dcp import PickleOnlyMetadataWarning
    from gdsckpt.integrations.convert import ConvertError, UnsafePickleError
    from gdsckpt.lossy import LossyWarning
    from gdsckpt.manager import SkippedCheckpointWarning
    from gdsckpt.tools.storagebench import InsufficientSpaceError

    assert (ConvertError, UnsafePickleError, InsufficientSpaceError, SkippedCheckpointWarning, LossyWarning,
            PickleOnlyMetadataWarning) == (gdsckpt.ConvertError, gdsckpt.UnsafePickleError,
                                           gdsckpt.InsufficientSpaceError, gdsckpt.SkippedCheckpointWarning,
                                           gdsckpt.LossyWarning, gdsckpt.PickleOnlyMetadataWarning)


def test_a_newer_major_version_is_told_apart_from_a_damaged_header(tmp_path: Path) -> None:
    """A higher major version in a header whose checksum holds is a newer writer's file
    (``NewerFormatError``); with the checksum broken it is no proof of that (damage)."""
    import struct

    from gdsckpt.format import checksum

    path = tmp_path / "x.gdsckpt"
    gdsckpt.save({"w": torch.arange(10)}, path)
    data = bytearray(path.read_bytes())
    data[8:10] = struct.pack("<H", 2)  # the major version
    data[60:64] = struct.pack("<I", checksum(bytes(data[:60])))
    path.write_bytes(bytes(data))
    with pytest.raises(gdsckpt.NewerFormatError, match="version 2"):
        gdsckpt.load(path)
    data[60] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(gdsckpt.UnsupportedFormatError) as raised:
        gdsckpt.load(path)
    assert not isinstance(raised.value, gdsckpt.NewerFormatError)


def test_a_corrupt_checkpoint_error_keeps_its_parts_through_pickle() -> None:
    """A save worker process hands its errors back pickled: the default pickling rebuilt a
    ``CorruptCheckpointError`` from its whole message, its ``key``, ``chunk`` and ``base`` lost."""
    import pickle

    error = gdsckpt.CorruptCheckpointError("chunk checksum mismatch", key="w", chunk=3, base="/ckpt/a.gdsckpt")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert (copy.reason, copy.key, copy.chunk, copy.base) == ("chunk checksum mismatch", "w", 3, "/ckpt/a.gdsckpt")
