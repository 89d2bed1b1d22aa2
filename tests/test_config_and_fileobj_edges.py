"""Configuration values and file objects that earlier gave an unclear error, or were accepted
and silently misused (a review of ``Config`` and the file-object API)."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import pytest
import torch

import gdsckpt
from gdsckpt import Config


@pytest.mark.parametrize("level", [-5, -1, 10, 100, 10**30])
def test_a_deflate_level_outside_0_to_9_is_refused(level: int) -> None:
    """-5 was clamped to 0 and stored the data uncompressed (1,053,101 bytes against 8,622)."""
    with pytest.raises(ValueError, match=r"not a valid deflate compression level: 0 to 9"):
        Config(codec="deflate", level=level)


def test_a_huge_zstd_level_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"level=10+ is not a valid zstd"):
        Config(level=10**30)
    with pytest.raises(ValueError, match=r"GDSCKPT_LEVEL"):
        Config.from_env({"GDSCKPT_LEVEL": "9" * 20})


@pytest.mark.parametrize("text", ["4i", "8ib", "4096 i"])
def test_a_size_whose_unit_is_only_i_is_refused(text: str) -> None:
    """A bare ``KeyError: 'i'``, from every place a size is taken."""
    with pytest.raises(ValueError, match="not a byte size"):
        Config(chunk_bytes=text)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="GDSCKPT_CHUNK_BYTES"):
        Config.from_env({"GDSCKPT_CHUNK_BYTES": text})


def test_an_environment_value_config_refuses_names_its_variable() -> None:
    with pytest.raises(ValueError, match=r"io_threads.*from the environment: GDSCKPT_IO_THREADS"):
        Config.from_env({"GDSCKPT_IO_THREADS": "0"})


def test_a_toml_integer_too_large_for_a_float_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"timeout = {'9' * 400}\n")
    with pytest.raises(ValueError, match=r"timeout = 9+ is too large"):
        Config.from_toml(path)


@pytest.mark.parametrize("config", ["portable", {"codec": "zstd"}])
def test_a_config_that_is_no_config_is_a_type_error_naming_it(tmp_path: Path, config: object) -> None:
    """``AttributeError: 'str' object has no attribute 'io_threads'`` from deep inside."""
    with pytest.raises(TypeError, match=r"config= takes a gdsckpt\.Config"):
        gdsckpt.save({"w": torch.ones(3)}, tmp_path / "a.gdsckpt", config=config)  # type: ignore[arg-type]
    assert not (tmp_path / "a.gdsckpt").exists()
    with pytest.raises(TypeError, match=r"Config\.preset\('portable'\)"):
        gdsckpt.load(tmp_path / "a.gdsckpt", config="portable")  # type: ignore[arg-type]


def test_a_save_into_an_append_mode_file_positioned_before_its_end_is_refused(tmp_path: Path) -> None:
    """Its writes went to the end, and the commit cut the file short: success reported, a file
    no load read ("bad magic number")."""
    path = tmp_path / "a.bin"
    path.write_bytes(b"old content")
    with open(path, "a+b") as handle:
        handle.seek(0)
        with pytest.raises(ValueError, match="append mode"):
            gdsckpt.save({"w": torch.ones(3)}, handle)
    assert path.read_bytes() == b"old content"
    with open(path, "ab") as handle:  # at its end: the checkpoint follows the old content
        gdsckpt.save({"w": torch.arange(3.0)}, handle)
    with open(path, "rb") as handle:
        handle.seek(len(b"old content"))
        assert torch.equal(gdsckpt.load(handle)["w"], torch.arange(3.0))


def test_a_file_object_positioned_past_its_end_is_a_checkpoint_error() -> None:
    """NumPy's "negative dimensions are not allowed"."""
    buffer = io.BytesIO()
    gdsckpt.save({"w": torch.arange(4.0)}, buffer)
    for read in (gdsckpt.load, gdsckpt.inspect, gdsckpt.verify):
        buffer.seek(len(buffer.getvalue()) + 100)
        with pytest.raises(gdsckpt.CheckpointError):
            read(buffer)


def test_a_gzip_file_object_saves_and_loads(tmp_path: Path) -> None:
    """``GzipFile.mode`` is an int: ``TypeError: argument of type 'int' is not iterable``."""
    path = tmp_path / "a.gdsckpt.gz"
    state = {"w": torch.tensor([1.0, -0.0, float("nan")])}
    with gzip.open(path, "wb") as handle:
        gdsckpt.save(state, handle)
    with gzip.open(path, "rb") as handle:
        loaded = gdsckpt.load(io.BytesIO(handle.read()))
    assert torch.equal(loaded["w"].view(torch.int32), state["w"].view(torch.int32))


@pytest.mark.skipif(not hasattr(__import__("os"), "O_APPEND"), reason="needs O_APPEND")
def test_a_save_into_a_descriptor_opened_to_append_is_refused(tmp_path: Path) -> None:
    """``os.fdopen`` of an ``O_APPEND`` descriptor (mode "wb"), as stdout under a shell's ``>>``:
    the writes went to the end and the commit truncated the file, destroying the old content
    with success reported."""
    import os

    path = tmp_path / "a.bin"
    old = b"precious existing content\n" * 400
    path.write_bytes(old)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND), "wb") as handle, \
            pytest.raises(ValueError, match="O_APPEND"):
        gdsckpt.save({"w": torch.ones(3)}, handle)
    assert path.read_bytes() == old


def test_a_checkpoint_inside_a_zip_archive_loads_from_its_member() -> None:
    """A zip member is a binary file object whose ``mode`` is ``"r"``: it was refused as text."""
    import zipfile

    state = {"w": torch.arange(1000.0)}
    blob, archive = io.BytesIO(), io.BytesIO()
    gdsckpt.save(state, blob)
    with zipfile.ZipFile(archive, "w") as writer:
        writer.writestr("ckpt.gdsckpt", blob.getvalue())
    with zipfile.ZipFile(archive) as reader, reader.open("ckpt.gdsckpt") as member:
        assert torch.equal(gdsckpt.load(member)["w"], state["w"])
    with pytest.raises(TypeError, match="text mode"):  # a text-mode file object is still refused
        gdsckpt.load(io.StringIO("not bytes"))


def test_append_checks_leave_gzip_and_spooled_files_as_they_were(tmp_path: Path) -> None:
    """The O_APPEND check asked every file object for its descriptor and its end: a GzipFile
    opened "ab" then failed with "Seek from end not supported", and a SpooledTemporaryFile was
    moved to disk by the question."""
    import tempfile

    state = {"w": torch.arange(100.0)}
    path = tmp_path / "c.gz"
    with gzip.open(path, "ab") as handle:
        gdsckpt.save(state, handle)
    with gzip.open(path, "rb") as handle:
        assert torch.equal(gdsckpt.load(handle.read())["w"], state["w"])
    with tempfile.SpooledTemporaryFile(max_size=1 << 30) as spooled:
        gdsckpt.save(state, spooled)
        assert not spooled._rolled
        spooled.seek(0)
        assert torch.equal(gdsckpt.load(spooled.read())["w"], state["w"])


class _RawOverBytes(io.RawIOBase):
    """A seekable, readable raw stream over a ``BytesIO``: the base of the file objects below."""

    def __init__(self, initial: bytes = b""):
        self._inner = io.BytesIO(initial)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._inner.seek(offset, whence)

    def tell(self) -> int:
        return self._inner.tell()


class _NoTruncate(_RawOverBytes):
    """A seekable binary file object with no ``truncate`` (a wrapper many libraries hand out),
    over a ``BytesIO``; ``fail_after`` writes it raises EIO."""

    def __init__(self, initial: bytes = b"", fail_after: int | None = None):
        super().__init__(initial)
        self._fail_after = fail_after

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        if self._fail_after is not None:
            if self._fail_after == 0:
                raise OSError(5, "injected EIO")
            self._fail_after -= 1
        return self._inner.write(data)

    def readinto(self, buffer: bytearray) -> int:  # type: ignore[override]
        return self._inner.readinto(buffer)

    def __getattribute__(self, name: str):  # type: ignore[no-untyped-def]
        if name == "truncate":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute 'truncate'")
        return super().__getattribute__(name)


def test_a_failed_save_into_a_file_object_without_truncate_raises_its_own_error() -> None:
    """Without ``truncate``, a failed write came out as ``AttributeError: ... 'truncate'`` (the
    EIO only its context), and a save over longer content as the same ``AttributeError`` instead
    of the documented ``OSError``."""
    state = {"w": torch.arange(100_000.0)}
    with pytest.raises(OSError, match="injected EIO"):
        gdsckpt.save(state, _NoTruncate(fail_after=1), chunk_bytes=64 << 10)
    with pytest.raises(OSError, match="cannot truncate"):
        gdsckpt.save({"w": torch.ones(3)}, _NoTruncate(initial=b"x" * (1 << 20)))


def test_a_bytearray_or_memoryview_source_is_read_in_place() -> None:
    """``io.BytesIO`` shares the memory of ``bytes`` only: a ``bytearray`` or ``memoryview``
    source was copied whole (a second copy of the file in memory, for ``inspect`` too). Read in
    place now: a change to the buffer's bytes is seen by the next read (the checksum catches
    it), which a copy would hide; the buffer can be resized again once the load is over."""
    state = {"w": torch.arange(4096.0)}
    blob = io.BytesIO()
    gdsckpt.save(state, blob, codec="none")
    data = bytearray(blob.getvalue())
    for source in (data, memoryview(data), memoryview(bytes(data))):
        assert torch.equal(gdsckpt.load(source)["w"], state["w"])
    data.extend(b"\0")  # no export of it left open
    del data[-1]
    with gdsckpt.open(data) as checkpoint:
        start = bytes(data).find(state["w"].numpy().tobytes()[:64])
        data[start] ^= 0xFF  # the open reader reads this buffer, not a copy of it
        with pytest.raises(gdsckpt.CorruptCheckpointError, match="checksum"):
            checkpoint.get("w")


def test_a_closed_file_object_reader_leaves_the_file_where_close_put_it() -> None:
    """``Checkpoint.close()`` while another thread's read was queued: the read ran after the
    close, and left the caller's file object mid-file instead of after the checkpoint."""
    import numpy as np

    from gdsckpt.io.fileobj import FileObjectReader

    blob = io.BytesIO()
    gdsckpt.save({"w": torch.arange(1000.0)}, blob)
    blob.seek(0)
    reader = FileObjectReader(blob)
    reader.close()
    with pytest.raises(ValueError, match="closed"):
        reader.submit_read(0, np.empty(16, dtype=np.uint8))
    assert blob.tell() == len(blob.getvalue())


def test_a_non_blocking_stream_with_no_data_is_named_as_such() -> None:
    """A raw stream whose ``readinto`` answers None (no data ready) was reported as a file that
    shrank while being read."""

    class NonBlocking(_RawOverBytes):
        _starved = False

        def readinto(self, buffer: bytearray) -> int | None:  # type: ignore[override]
            if self._inner.tell() > 0 and not self._starved:  # the index read works, a chunk's not
                self._starved = True
                return None
            return self._inner.readinto(buffer)

    blob = io.BytesIO()
    gdsckpt.save({"w": torch.arange(100_000.0)}, blob, codec="none")
    with pytest.raises((gdsckpt.CheckpointError, BlockingIOError), match="non-blocking"):
        gdsckpt.load(NonBlocking(blob.getvalue()))
