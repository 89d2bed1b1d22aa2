"""Habits from torch.save / torch.load / safetensors that gdsckpt honours (issue 21): map_location,
binary file objects and bytes, "just the weights" from a full training checkpoint, a warning for a
file named like another format, small files without a page per dtype, report names that say what
they count."""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import gdsckpt
from gdsckpt.api.saving import save_flat
from gdsckpt.format.layout import ALIGNMENT
from gdsckpt.state import flatten


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(300, 40, generator=g), "b": torch.randn(40, generator=g).to(torch.bfloat16)},
            "step": torch.tensor(7), "note": "hi", "lr": 0.5}


def _training(width: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(width)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.ones(3, width)).sum().backward()
    optimizer.step()
    return model, optimizer


# -- map_location -----------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["cpu", torch.device("cpu"), {"cpu": "cpu"}])
def test_map_location_takes_torch_meanings(ckpt_path: Path, h: Any, where: Any) -> None:
    state = _state()
    gdsckpt.save(state, ckpt_path)
    loaded = gdsckpt.load(ckpt_path, map_location=where)
    h.assert_same(state, loaded)
    assert loaded["model"]["w"].device.type == "cpu"
    with gdsckpt.open(ckpt_path) as checkpoint:
        assert h.tensor_bytes(checkpoint.get("model/w", map_location=where)) == h.tensor_bytes(state["model"]["w"])


@pytest.mark.parametrize("weights_only", [True, False, None])
def test_weights_only_is_taken_and_changes_nothing(ckpt_path: Path, h: Any, weights_only: Any) -> None:
    """``torch.load(p, weights_only=True)`` is how torch's callers write a load; the same call to
    gdsckpt raised ``TypeError``. Every gdsckpt load is weights-only (no code runs from the file),
    so the argument is taken and the state loads as it would without it."""
    state = _state()
    gdsckpt.save(state, ckpt_path)
    h.assert_same(state, gdsckpt.load(ckpt_path, map_location="cpu", weights_only=weights_only))


def test_weights_only_that_is_not_a_bool_is_a_type_error(ckpt_path: Path) -> None:
    gdsckpt.save(_state(), ckpt_path)
    with pytest.raises(TypeError, match="weights_only must be a bool or None, got str"):
        gdsckpt.load(ckpt_path, weights_only="yes")


def test_map_location_dict_remaps_the_device_an_array_was_saved_from(ckpt_path: Path, h: Any) -> None:
    """A file whose arrays record ``cuda:1`` (written here by the CPU engine, the devices given as a
    background save gives them) loads with ``{"cuda:1": "cpu"}`` on a machine without that GPU."""
    state = {"w": torch.arange(12.0).reshape(3, 4), "i": torch.arange(5)}
    save_flat(flatten(state), ckpt_path, devices=["cuda:1", "cuda:1"], config=gdsckpt.Config(engine="cpu"))
    assert {t.device for t in gdsckpt.inspect(ckpt_path).tensors} == {"cuda:1"}
    loaded = gdsckpt.load(ckpt_path, map_location={"cuda:1": "cpu"})
    h.assert_same(state, loaded)
    assert loaded["w"].device.type == "cpu"
    with gdsckpt.open(ckpt_path) as checkpoint:
        assert torch.equal(checkpoint.get_many(["i"], map_location={"cuda:1": "cpu"})["i"], state["i"])
    if not torch.cuda.is_available():
        # An array from a device the dict does not map goes where it was saved from, as torch.load does.
        with pytest.raises(ValueError, match="'w' was saved from 'cuda:1'.*CUDA is not available"):
            gdsckpt.load(ckpt_path, map_location={"cuda:0": "cpu"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine without a GPU is the case")
def test_map_location_dict_checks_a_gpu_only_where_an_array_maps_to_it(ckpt_path: Path, h: Any) -> None:
    """A training script's ``{"cuda:1": "cuda:0"}`` loads a CPU-saved file on a machine without
    GPUs (torch.load does too); an array that maps to the missing GPU is an error naming it."""
    state = _state()
    gdsckpt.save(state, ckpt_path)
    h.assert_same(state, gdsckpt.load(ckpt_path, map_location={"cuda:1": "cuda:0"}))
    with gdsckpt.open(ckpt_path) as checkpoint:
        assert h.tensor_bytes(checkpoint.get("model/w", map_location={"cuda": "cuda:1"})) == \
            h.tensor_bytes(state["model"]["w"])
    with pytest.raises(ValueError, match="'model/w' was saved from 'cpu', which map_location maps to 'cuda:0'.*"
                                         "CUDA is not available"):
        gdsckpt.load(ckpt_path, map_location={"cpu": "cuda:0"})
    with pytest.raises(ValueError, match="device 'cuda:x' is invalid"):  # the syntax is checked at once
        gdsckpt.load(ckpt_path, map_location={"cuda:1": "cuda:x"})


def test_map_location_misuse_is_a_clear_error(ckpt_path: Path) -> None:
    gdsckpt.save(_state(), ckpt_path)
    with pytest.raises(TypeError, match="device= or map_location=, not both"):
        gdsckpt.load(ckpt_path, device="cpu", map_location="cpu")
    with pytest.raises(TypeError, match="map_location as a function is not supported.*a dict"):
        gdsckpt.load(ckpt_path, map_location=lambda storage, location: storage)
    with pytest.raises(ValueError, match="map_location key 'gpu1' is not a device"):
        gdsckpt.load(ckpt_path, map_location={"gpu1": "cpu"})
    with pytest.raises(ValueError, match="device 'tpu' is invalid"):
        gdsckpt.load(ckpt_path, map_location="tpu")
    # "cuda" is "cuda:0": one dict naming both, to different places, was resolved by key order
    with pytest.raises(ValueError, match="maps 'cuda:0' twice"):
        gdsckpt.load(ckpt_path, map_location={"cuda": "cpu", "cuda:0": "cuda:1"})
    h_loaded = gdsckpt.load(ckpt_path, map_location={"cuda": "cpu", "cuda:0": "cpu"})  # the same place: fine
    assert h_loaded["model"]["w"].device.type == "cpu"
    with gdsckpt.open(ckpt_path) as checkpoint, pytest.raises(TypeError, match="not both"):
        checkpoint.get("model/w", device="cpu", map_location="cpu")


# -- file objects and bytes -------------------------------------------------------------------

def test_save_to_bytesio_and_load_it_back_bit_exact(tmp_path: Path, h: Any) -> None:
    state = _state()
    buffer = io.BytesIO()
    report = gdsckpt.save(state, buffer, codec="none")
    assert report.path == "<fileobj>" and report.file_bytes == len(buffer.getvalue())
    # The same bytes a file holds: a file object is a place to write the format, nothing else.
    gdsckpt.save(state, tmp_path / "same.gdsckpt", codec="none")
    assert buffer.getvalue() == (tmp_path / "same.gdsckpt").read_bytes()
    buffer.seek(0)
    h.assert_same(state, gdsckpt.load(buffer))
    assert buffer.tell() == report.file_bytes  # left after the checkpoint, as torch.load leaves it
    h.assert_same(state, gdsckpt.load(buffer.getvalue()))
    h.assert_same(state, gdsckpt.load(bytearray(buffer.getvalue())))
    assert gdsckpt.inspect(buffer.getvalue()).path == "<bytes>"
    buffer.seek(0)
    assert gdsckpt.verify(buffer).chunk_bytes > 0
    buffer.seek(0)
    with gdsckpt.open(buffer) as checkpoint:
        assert torch.equal(checkpoint.get("model/w"), state["model"]["w"])


def test_save_async_to_bytesio_writes_the_buffer(tmp_path: Path, h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``save_async`` to a file object wrote a file named after its ``repr`` in the working
    directory (``<_io.BytesIO object at 0x...>``) and left the buffer empty, reporting success."""
    monkeypatch.chdir(tmp_path)
    state, buffer = _state(), io.BytesIO()
    report = gdsckpt.save_async(state, buffer).wait(timeout=60)
    assert os.listdir(tmp_path) == [] and report.file_bytes == len(buffer.getvalue())
    buffer.seek(0)
    h.assert_same(state, gdsckpt.load(buffer))
    with pytest.raises(TypeError, match="worker process"):  # a file object cannot go to another process
        gdsckpt.save_async(state, io.BytesIO(), config=gdsckpt.Config(async_worker="process"))


@pytest.mark.parametrize("target", [None, 3, b"x.gdsckpt", ["x.gdsckpt"]], ids=["none", "int", "bytes", "list"])
def test_save_and_save_async_refuse_a_target_that_is_no_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            target: Any) -> None:
    """``save_async(state, None)`` wrote a file named ``None`` in the working directory, and
    ``3``, ``b"x"`` or a list likewise under their ``str``, reporting success."""
    monkeypatch.chdir(tmp_path)
    for save in (gdsckpt.save, gdsckpt.save_async):
        with pytest.raises(TypeError, match="saved to a path"):
            save(_state(), target)
    assert os.listdir(tmp_path) == []


def test_a_save_over_a_longer_checkpoint_in_a_file_object_leaves_no_old_tail(tmp_path: Path, h: Any) -> None:
    """``open(p, "r+b")`` over a longer checkpoint (or a reused ``BytesIO``): the old index and
    trailer stayed at the end, and ``load(keys=...)`` returned the old file's arrays without an
    error. A seekable file object is now cut at the checkpoint's end."""
    old = {"z": torch.arange(50_000, dtype=torch.float32), "pad": torch.ones(200_000)}
    new = {"z": torch.zeros(10)}
    path = tmp_path / "a.gdsckpt"
    gdsckpt.save(old, path)
    with open(path, "r+b") as handle:
        report = gdsckpt.save(new, handle)
    assert path.stat().st_size == report.file_bytes
    h.assert_same(new, gdsckpt.load(path))
    buffer = io.BytesIO()
    gdsckpt.save(old, buffer)
    buffer.seek(0)
    gdsckpt.save(new, buffer)
    h.assert_same(new, gdsckpt.load(buffer.getvalue(), keys=["z"]))


def test_a_file_object_that_cannot_cut_an_older_tail_fails_the_save(h: Any) -> None:
    """Older bytes after the checkpoint that the file object cannot truncate would load as its
    index: the save fails instead of reporting success."""
    class NoTruncate(io.BytesIO):
        def truncate(self, size: Any = None) -> int:
            raise io.UnsupportedOperation("truncate")

    buffer = NoTruncate()
    gdsckpt.save({"z": torch.arange(100_000, dtype=torch.float32)}, buffer)
    buffer.seek(0)
    with pytest.raises(OSError, match="cannot truncate"):
        gdsckpt.save({"z": torch.zeros(3)}, buffer)
    fresh = NoTruncate()  # nothing after the checkpoint: nothing to cut, the save succeeds
    gdsckpt.save({"z": torch.zeros(3)}, fresh)
    h.assert_same({"z": torch.zeros(3)}, gdsckpt.load(fresh.getvalue()))


def test_a_file_object_save_that_fails_before_its_first_chunk_leaves_it_as_it_was(tmp_path: Path) -> None:
    """A save that failed at its first chunk (an encoder's error) truncated the file object to
    where it started: an existing checkpoint opened ``r+b``, or a ``BytesIO`` of other data, was
    emptied though the save had only written its header."""
    from gdsckpt.io import fileobj

    buffer = io.BytesIO(b"precious" * 100)
    original = fileobj.FileObjectWriter._write_at

    def failing_chunk(self: Any, offset: int, view: memoryview) -> None:
        if offset > 0:
            raise OSError("injected failure of the first chunk's write")
        original(self, offset, view)

    fileobj.FileObjectWriter._write_at = failing_chunk  # type: ignore[method-assign]
    try:
        with pytest.raises(OSError, match="injected"):
            gdsckpt.save(_state(), buffer)
    finally:
        fileobj.FileObjectWriter._write_at = original  # type: ignore[method-assign]
    assert buffer.getvalue() == b"precious" * 100


def test_a_stream_that_takes_no_bytes_is_an_error_not_a_hang() -> None:
    class Stuck(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            return 0

    with pytest.raises(OSError, match="took no bytes"):
        gdsckpt.save(_state(), Stuck())


def test_file_objects_are_read_and_written_from_their_position(tmp_path: Path, h: Any) -> None:
    state = _state()
    path = tmp_path / "in_a_file.bin.gdsckpt"
    with open(path, "wb") as handle:
        handle.write(b"prefix")
        report = gdsckpt.save(state, handle)
    assert path.stat().st_size == len(b"prefix") + report.file_bytes
    with open(path, "rb") as handle:
        assert handle.read(6) == b"prefix"
        h.assert_same(state, gdsckpt.load(handle))
        assert not handle.closed  # the caller's to close


def test_two_checkpoints_in_one_stream_the_first_is_refused_as_appended_to(h: Any) -> None:
    """``torch.load`` reads the first of two saves made one after the other into one stream; a
    gdsckpt checkpoint's index is at its end, so the first cannot be found: it is refused, saying
    that a checkpoint must end the stream, and the second, read from its own start, loads."""
    first, second = {"w": torch.arange(4.0)}, {"w": torch.arange(6.0)}
    stream = io.BytesIO()
    gdsckpt.save(first, stream)
    at = stream.tell()
    gdsckpt.save(second, stream)
    stream.seek(0)
    with pytest.raises(gdsckpt.CorruptCheckpointError, match="appended to .*ends its file, or the stream"):
        gdsckpt.load(stream)
    stream.seek(at)
    h.assert_same(second, gdsckpt.load(stream))


class _Stream:
    """A write-only, non-seekable binary stream that records the size of every write."""

    mode = "wb"

    def __init__(self) -> None:
        self.data = bytearray()
        self.writes: list[int] = []

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.data += view
        self.writes.append(len(view))
        return len(view)

    def seekable(self) -> bool:
        return False


def test_a_save_streams_into_a_non_seekable_file_object_chunk_by_chunk(h: Any) -> None:
    """The file is written front to back as chunks are encoded, never assembled whole first."""
    g = torch.Generator().manual_seed(2)
    state = {f"w{i}": torch.randn(64 << 10, generator=g) for i in range(4)}  # 1 MiB in 256 KiB arrays
    config = gdsckpt.Config(chunk_bytes=64 << 10, pack_below=4 << 10, max_inflight_bytes=256 << 10)
    stream = _Stream()
    report = gdsckpt.save(state, stream, codec="none", config=config)
    assert len(stream.data) == report.file_bytes and report.chunks == 16
    assert max(stream.writes) <= 64 << 10  # no write holds more than a chunk
    h.assert_same(state, gdsckpt.load(bytes(stream.data)))


def test_load_needs_a_seekable_binary_file_object(ckpt_path: Path) -> None:
    gdsckpt.save(_state(), ckpt_path)

    class Unseekable(io.RawIOBase):
        def readable(self) -> bool:
            return True

    with pytest.raises(ValueError, match=r"seekable.*load\(f.read\(\)\)"):
        gdsckpt.load(Unseekable())
    with open(ckpt_path, encoding="latin-1") as text, pytest.raises(TypeError, match="binary file object"):
        gdsckpt.load(text)
    with pytest.raises(TypeError, match="readable binary file object, got int"):
        gdsckpt.load(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="binary file object"):
        gdsckpt.save(_state(), io.StringIO())


# -- just the weights -------------------------------------------------------------------------

def test_just_the_weights_from_a_full_training_checkpoint_is_a_one_liner(ckpt_path: Path, h: Any) -> None:
    model, optimizer = _training()
    gdsckpt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 3}, ckpt_path)
    fresh, _ = _training(width=8)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    gdsckpt.load_into({"model": fresh}, ckpt_path)  # the optimizer and step are not asked for
    for key, value in model.state_dict().items():
        assert h.tensor_bytes(fresh.state_dict()[key]) == h.tensor_bytes(value), key

    # An exact match can still be demanded: every entry of the file must be in the target.
    with pytest.raises(gdsckpt.StateMismatchError) as caught:
        gdsckpt.load_into({"model": fresh}, ckpt_path, strict="exact")
    assert "'optimizer/state/0/exp_avg': in checkpoint, missing from target" in str(caught.value)
    assert "'step': in checkpoint, missing from target" in str(caught.value)
    # Within what the target asks for, strictness stays: a module with fewer layers is refused.
    smaller = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(gdsckpt.StateMismatchError, match="'model/2.weight': in checkpoint, missing from target"):
        gdsckpt.load_into({"model": smaller}, ckpt_path)
    # And what the target asks for and the file lacks is an error whatever strict says.
    with pytest.raises(gdsckpt.StateMismatchError, match="'epoch': in target, missing from checkpoint"):
        gdsckpt.load_into({"model": fresh, "epoch": 0}, ckpt_path, strict=False)
    with pytest.raises(ValueError, match="strict must be True, False or 'exact'"):
        gdsckpt.load_into({"model": fresh}, ckpt_path, strict="loose")


# -- a file named like another format ---------------------------------------------------------

@pytest.mark.parametrize("name", ["x.pt", "x.pth", "x.bin", "x.safetensors", "x.ckpt", "x.NPZ"])
def test_saving_under_another_formats_extension_warns(tmp_path: Path, h: Any, name: str) -> None:
    state = _state()
    with pytest.warns(gdsckpt.ForeignExtensionWarning, match=r"gdsckpt convert") as record:
        gdsckpt.save(state, tmp_path / name)
    assert len(record) == 1 and record[0].filename == __file__  # it points at the caller's line
    assert issubclass(gdsckpt.ForeignExtensionWarning, UserWarning)
    h.assert_same(state, gdsckpt.load(tmp_path / name))  # written all the same


def test_save_async_warns_in_the_caller_and_gdsckpt_names_do_not(tmp_path: Path) -> None:
    with pytest.warns(gdsckpt.ForeignExtensionWarning) as record:
        gdsckpt.save_async(_state(), tmp_path / "y.pt").wait()
    assert len(record) == 1 and record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gdsckpt.save(_state(), tmp_path / "y.gdsckpt")
        gdsckpt.save(_state(), tmp_path / "no_extension")
        gdsckpt.save(_state(), io.BytesIO())


# -- small files ------------------------------------------------------------------------------

def test_a_tiny_state_of_several_dtypes_takes_one_chunk(tmp_path: Path, h: Any) -> None:
    """One page of padding for the data, not one per dtype: a state of a few hundred bytes in four
    plane widths is header page + one chunk page + index + trailer."""
    state = {"w": torch.randn(16), "b": torch.randn(4).to(torch.bfloat16), "step": torch.tensor(3),
             "mask": torch.ones(3, dtype=torch.bool), "lr": 0.1}
    for codec in ("none", "zstd"):
        path = tmp_path / f"tiny-{codec}.gdsckpt"
        report = gdsckpt.save(state, path, codec=codec)
        assert report.chunks == 1, report
        index_and_trailer = report.file_bytes - 2 * ALIGNMENT
        assert 0 < index_and_trailer < ALIGNMENT, report.file_bytes
        h.assert_same(state, gdsckpt.load(path))
        assert gdsckpt.verify(path).chunks == 1


def test_states_with_larger_arrays_keep_their_packing_by_width(tmp_path: Path) -> None:
    state = {"big": torch.zeros(8192), "w": torch.randn(16), "step": torch.tensor(3)}
    config = gdsckpt.Config(chunk_bytes=16 << 10, pack_below=16 << 10)
    report = gdsckpt.save(state, tmp_path / "mixed.gdsckpt", codec="none", config=config)
    assert report.chunks == 4  # big (two chunks of its own) + a float32 pack + an int64 pack


# -- reports that say what they count ---------------------------------------------------------

def test_save_and_verify_reports_name_their_byte_counts_apart(ckpt_path: Path) -> None:
    saved = gdsckpt.save(_state(), ckpt_path)
    verified = gdsckpt.verify(ckpt_path)
    chunks = gdsckpt.inspect(ckpt_path).chunks
    assert saved.file_bytes == os.path.getsize(ckpt_path) == gdsckpt.inspect(ckpt_path).file_bytes
    assert verified.chunk_bytes == sum(c.stored_bytes for c in chunks) < saved.file_bytes
    with pytest.warns(DeprecationWarning, match=r"SaveReport.stored_bytes is deprecated: use file_bytes"):
        assert saved.stored_bytes == saved.file_bytes
    with pytest.warns(DeprecationWarning, match=r"VerifyReport.stored_bytes is deprecated: use chunk_bytes"):
        assert verified.stored_bytes == verified.chunk_bytes


def test_two_keys_that_are_one_plain_key_are_refused_by_every_save(tmp_path: Path) -> None:
    """A str subclass hashing its own way keeps two entries a checkpoint stores under one key:
    ``gdsckpt.save`` wrote a file every load refused ("repeats a key"), and ``save_async``'s
    snapshot kept the last entry only, without a word."""

    class Key(str):
        def __hash__(self) -> int:
            return 12345

    state = {"k": 1, Key("k"): 2, "t": torch.ones(2)}
    with pytest.raises(ValueError, match="two keys that are both 'k'"):
        gdsckpt.save(state, tmp_path / "a.gdsckpt")
    with pytest.raises(ValueError, match="two keys that are both 'k'"):
        gdsckpt.save_async(state, tmp_path / "b.gdsckpt")
    assert not list(tmp_path.iterdir())


def test_a_cpu_device_with_an_index_is_the_cpu(tmp_path: Path) -> None:
    """torch takes ``"cpu:0"`` and ``torch.device("cpu", 0)``; gdsckpt refused both as invalid."""
    path = tmp_path / "c.gdsckpt"
    gdsckpt.save({"w": torch.arange(4.0)}, path)
    for location in ("cpu:0", torch.device("cpu", 0)):
        assert torch.equal(gdsckpt.load(path, map_location=location)["w"], torch.arange(4.0))
        assert gdsckpt.load(path, device=location)["w"].device.type == "cpu"


@pytest.mark.parametrize("write, says", [
    (lambda p: torch.save({"a": torch.ones(2)}, p), "zip archive, as torch.save writes"),
    (lambda p: torch.save({"a": torch.ones(2)}, p, _use_new_zipfile_serialization=False), "a pickle"),
    (lambda p: __import__("safetensors.torch").torch.save_file({"a": torch.ones(2)}, str(p)), "safetensors file"),
])
def test_loading_another_format_says_which_and_how_to_convert(tmp_path: Path, write: Any, says: str) -> None:
    """Only "not a gdsckpt checkpoint (bad magic number at offset 0)" before."""
    path = tmp_path / "other.bin"
    write(path)
    with pytest.raises(gdsckpt.UnsupportedFormatError, match=f"{says}.*gdsckpt convert"):
        gdsckpt.load(path)


def test_bytes_that_name_a_file_say_a_path_was_meant(tmp_path: Path) -> None:
    path = tmp_path / "c.gdsckpt"
    gdsckpt.save({"w": torch.ones(2)}, path)
    with pytest.raises(gdsckpt.UnsupportedFormatError, match="pass the path as a str"):
        gdsckpt.load(str(path).encode())
    with pytest.raises(gdsckpt.UnsupportedFormatError, match=r"bad magic number at offset 0\)$"):
        gdsckpt.load(b"no file of this name and no checkpoint")


@pytest.mark.parametrize("name", [None, Path("portable"), 3])
def test_a_preset_name_that_is_no_str_is_a_type_error_listing_the_presets(name: Any) -> None:
    """``Config.preset(None)`` was difflib's bare "'NoneType' object is not iterable"."""
    with pytest.raises(TypeError, match="Config.preset takes a preset's name, one of: .*portable"):
        gdsckpt.Config.preset(name)
