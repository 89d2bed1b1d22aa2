"""Running out of memory, interruption and I/O errors while restoring are no proof of damage.

``decode_host_chunk`` raises ``CorruptCheckpointError`` only for a checksum mismatch or a stream
the codec library rejects as corrupt; a ``MemoryError`` (also zstd's and zlib's own "out of
memory" errors), a ``KeyboardInterrupt``, a ``RuntimeError`` propagate as themselves.
``CheckpointManager.restore_latest`` falls back to an older checkpoint only on proof of damage or
a file that vanished; an out-of-memory error, an interruption or an I/O error (EIO reading the
index or a chunk) stops it: the error is raised, no older step is restored, no warning, the
targets untouched when no chunk was decoded, and nothing on disk changes. A damaged newest file
(a flipped byte, or a zstd frame with a valid checksum but a corrupt stream) still makes it fall
back with a ``SkippedCheckpointWarning``.

Faults are injected into the host codecs' ``decode`` (every chunk the CPU engine decodes goes
through one) and, for I/O errors, into ``os.preadv`` (``test_io_errors.Fault``).
"""

from __future__ import annotations

import errno
import os
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

import gdsckpt
from gdsckpt import CheckpointManager, SkippedCheckpointWarning
from gdsckpt.codecs.cpu import DeflateCodec, NoneCodec, ZstdCodec
from gdsckpt.format import checksum
from gdsckpt.format.layout import unpack_trailer

from .harness import record_figure
from .test_io_errors import Fault, _reads_at
from .worker import state_for

torch = pytest.importorskip("torch")

ELEMENTS = 20_000  # with 4 KiB chunks: 31 chunks
DECODERS = (ZstdCodec, NoneCodec, DeflateCodec)
"""Host codecs the checkpoints below use (zstd, or deflate, for compressible chunks, none for the
random weights): every chunk decode on the CPU passes through one of their ``decode``s."""


class DecodeFault:
    """Replaces the ``decode`` of ``DECODERS``: the calls from the ``after``-th on raise
    ``make()``; the others decode."""

    def __init__(self, make: Callable[[], BaseException], after: int = 0):
        self.make, self.after = make, after
        self.calls = self.raised = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> DecodeFault:
        for cls in DECODERS:
            monkeypatch.setattr(cls, "decode", self._wrap(cls.decode))
        return self

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def decode(codec: Any, data: Any, raw_length: int) -> Any:
            number, self.calls = self.calls, self.calls + 1
            if number >= self.after:
                self.raised += 1
                raise self.make()
            return original(codec, data, raw_length)
        return decode


@pytest.fixture
def config(h: Any) -> gdsckpt.Config:
    return h.small_config()


@pytest.fixture
def manager(tmp_path: Path, config: gdsckpt.Config) -> CheckpointManager:
    """Steps 1 and 2 (zstd), both intact; ``latest`` names step 2."""
    manager = CheckpointManager(tmp_path / "run", keep_last=None, config=config)
    for step in (1, 2):
        manager.save(step, state_for(step, ELEMENTS), codec="zstd")
    return manager


def _targets() -> dict[str, Any]:
    return {"weights": torch.zeros(ELEMENTS), "counts": torch.zeros(ELEMENTS // 4, dtype=torch.int64)}


def _bits(tensor: Any) -> bytes:
    return tensor.view(torch.uint8).numpy().tobytes()


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _restore(manager: CheckpointManager, targets: dict[str, Any], **kwargs: Any) -> tuple[Any, list[Any]]:
    """``restore_latest(state=targets)``: (its result, or the exception it raised; every warning)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result: Any = manager.restore_latest(state=targets, **kwargs)
        except BaseException as err:
            result = err
    return result, list(caught)


def _assert_restored(manager: CheckpointManager, step: int, h: Any) -> None:
    """A restore without faults returns ``step``, bit-exact."""
    targets = _targets()
    result, caught = _restore(manager, targets)
    assert not isinstance(result, BaseException), result
    assert result[0] == step and not [w for w in caught if w.category is SkippedCheckpointWarning]
    expected = state_for(step, ELEMENTS)
    assert _bits(targets["weights"]) == expected["weights"].tobytes()
    assert _bits(targets["counts"]) == expected["counts"].tobytes()
    h.assert_same({"version": expected["version"], "meta": expected["meta"]}, result[1])


# ---------------------------------------------------------------------------------------------
# the decode itself

@pytest.mark.parametrize("reader", ["load", "verify"])
def test_memory_error_while_decoding_is_raised_as_itself(reader: str, ckpt_path: Path, config: gdsckpt.Config,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    gdsckpt.save(state_for(1, ELEMENTS), ckpt_path, codec="zstd", config=config)
    with monkeypatch.context() as m:
        fault = DecodeFault(lambda: MemoryError("injected: no memory for the output"), after=5).install(m)
        with pytest.raises(MemoryError, match="injected") as caught:
            getattr(gdsckpt, reader)(ckpt_path, config=config)
    assert fault.raised >= 1 and not isinstance(caught.value, gdsckpt.CheckpointError)
    assert caught.value.__cause__ is not caught.value  # raised as it was, not as its own cause


# (codec, what the library raises, what the reader must raise)
LIBRARY_ERRORS = {
    "zstd out of memory": ("zstd", lambda: zstandard.ZstdError(
        "decompression error: Allocation error : not enough memory"), MemoryError),
    "zstd corrupt frame": ("zstd", lambda: zstandard.ZstdError(
        "decompression error: Data corruption detected"), gdsckpt.CorruptCheckpointError),
    "zlib out of memory": ("deflate", lambda: zlib.error("Error -4 while decompressing data"), MemoryError),
    "zlib corrupt stream": ("deflate", lambda: zlib.error(
        "Error -3 while decompressing data: invalid block type"), gdsckpt.CorruptCheckpointError),
    "another RuntimeError": ("zstd", lambda: RuntimeError("injected: a library failure"), RuntimeError),
}


@pytest.mark.parametrize("case", LIBRARY_ERRORS)
def test_codec_library_errors_are_told_apart(case: str, ckpt_path: Path, config: gdsckpt.Config,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A codec library's "out of memory" is a ``MemoryError``, its "corrupt stream" is damage, and
    any other error is raised as itself."""
    codec, make, expected = LIBRARY_ERRORS[case]
    gdsckpt.save(state_for(1, ELEMENTS), ckpt_path, codec=codec, config=config)
    with monkeypatch.context() as m:
        DecodeFault(make).install(m)
        with pytest.raises(BaseException) as caught:
            gdsckpt.load(ckpt_path, config=config)
    assert type(caught.value) is expected, repr(caught.value)
    causes, err = [], caught.value.__cause__
    while err is not None and len(causes) < 5:
        causes.append(type(err).__module__.split(".")[0])
        err = err.__cause__
    assert causes[-1:] == ([] if expected is RuntimeError else [{"zstd": "zstandard"}.get(codec, "zlib")]), causes


# ---------------------------------------------------------------------------------------------
# restore_latest: errors that are not damage stop it

@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("error", [MemoryError, KeyboardInterrupt])
def test_restore_latest_stops_on_memory_error_or_interrupt(error: type[BaseException], verify: bool,
                                                           manager: CheckpointManager,
                                                           monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    """The newest checkpoint is intact: running out of memory (or ^C) while decoding it raises
    that error; step 1 is not restored, nothing is written into the targets, no warning, the
    directory is unchanged. Once memory is back, step 2 restores bit-exact."""
    before = _snapshot(manager.directory)
    targets = _targets()
    with monkeypatch.context() as m:
        fault = DecodeFault(lambda: error("injected while decoding")).install(m)
        result, caught = _restore(manager, targets, verify=verify)
    assert fault.raised >= 1
    assert type(result) is error, f"restore_latest returned or raised {result!r}"
    assert not caught, [str(w.message) for w in caught]
    assert not targets["weights"].any() and not targets["counts"].any()  # untouched
    assert _snapshot(manager.directory) == before
    _assert_restored(manager, 2, h)
    record_figure(f"restore_latest(verify={verify}), {error.__name__} while decoding the newest",
                  f"{error.__name__} raised, no step restored, no warning")


def test_restore_latest_stops_on_memory_error_in_a_later_chunk(manager: CheckpointManager,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks decoded before the failure may have been written into the targets, but the older
    step is never restored over them."""
    targets = _targets()
    with monkeypatch.context() as m:
        DecodeFault(lambda: MemoryError("injected"), after=10).install(m)
        result, caught = _restore(manager, targets)
    assert type(result) is MemoryError and not caught
    assert _bits(targets["weights"]) != state_for(1, ELEMENTS)["weights"].tobytes()
    assert _bits(targets["counts"]) != state_for(1, ELEMENTS)["counts"].tobytes()


def test_restore_latest_raises_eio_reading_a_chunk(manager: CheckpointManager,
                                                   monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    """EIO reading a chunk of the newest checkpoint: the ``CheckpointError`` naming chunk and
    tensor (its cause the ``OSError``) is raised, nothing older is restored."""
    index = h.read_index(manager.path(2))
    chunk = len(index.chunks) // 2
    bad = _reads_at(index.chunks[chunk].offset, inode=manager.path(2).stat().st_ino)
    before = _snapshot(manager.directory)
    with monkeypatch.context() as m:
        fault = Fault("preadv", bad, errno.EIO).install(m)
        result, caught = _restore(manager, _targets())
    assert fault.raised >= 1 and not caught
    assert isinstance(result, gdsckpt.CheckpointError) and f"chunk {chunk}" in str(result), repr(result)
    assert isinstance(result.__cause__, OSError) and result.__cause__.errno == errno.EIO
    assert _snapshot(manager.directory) == before
    _assert_restored(manager, 2, h)


@pytest.mark.parametrize("verify", [False, True])
def test_restore_latest_raises_eio_reading_the_index(verify: bool, manager: CheckpointManager,
                                                     monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    """EIO reading the newest checkpoint's index (the cheap check before loading): raised."""
    data = manager.path(2).read_bytes()
    index_offset = unpack_trailer(data[-64:], len(data)).index_offset
    bad = _reads_at(index_offset, inode=manager.path(2).stat().st_ino)
    with monkeypatch.context() as m:
        fault = Fault("preadv", bad, errno.EIO).install(m)
        result, caught = _restore(manager, _targets(), verify=verify)
    assert fault.raised >= 1 and not caught
    assert isinstance(result, OSError) and result.errno == errno.EIO, repr(result)
    _assert_restored(manager, 2, h)


# ---------------------------------------------------------------------------------------------
# restore_latest: proof of damage, or a vanished file, still makes it fall back

def test_restore_latest_falls_back_over_a_flipped_byte(manager: CheckpointManager, h: Any) -> None:
    path = manager.path(2)
    index = h.read_index(path)
    data = bytearray(path.read_bytes())
    data[index.chunks[3].offset + 7] ^= 0x01
    path.write_bytes(bytes(data))
    targets = _targets()
    result, caught = _restore(manager, targets)
    assert not isinstance(result, BaseException), result
    assert result[0] == 1
    assert [w.category for w in caught] == [SkippedCheckpointWarning]
    assert "checksum mismatch" in str(caught[0].message)
    assert _bits(targets["weights"]) == state_for(1, ELEMENTS)["weights"].tobytes()


def test_zstd_frame_with_a_valid_checksum_but_a_corrupt_stream_is_damage(manager: CheckpointManager,
                                                                         h: Any) -> None:
    """A zstd chunk's stream garbled and its CRC-32C in the index recomputed (a crafted or
    miswritten file): ``CorruptCheckpointError`` "does not decode", and ``restore_latest`` falls
    back to step 1."""
    path = manager.path(2)
    index = h.read_index(path)
    number = next(i for i, record in enumerate(index.chunks)
                  if index.chains[record.chain][-1]["name"] == "zstd/1" and record.stored > 64)
    record = index.chunks[number]
    data = bytearray(path.read_bytes())
    body = slice(record.offset, record.offset + record.stored)
    stream = np.frombuffer(bytes(data[body]), dtype=np.uint8).copy()
    stream[12:] = np.random.default_rng(0).integers(0, 256, stream.size - 12, dtype=np.uint8)
    data[body] = stream.tobytes()
    path.write_bytes(bytes(data))

    def edit(doc: dict[str, Any]) -> None:
        doc["chunks"][number][3] = checksum(stream)

    h.rewrite_index(path, edit)
    with pytest.raises(gdsckpt.CorruptCheckpointError, match="does not decode") as err:
        gdsckpt.load(path, config=manager.config)
    assert err.value.chunk == number
    result, caught = _restore(manager, _targets())
    assert not isinstance(result, BaseException), result
    assert result[0] == 1 and [w.category for w in caught] == [SkippedCheckpointWarning]


def test_restore_latest_skips_a_file_that_vanished(manager: CheckpointManager,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The newest file is removed between its check and its load (a concurrent prune):
    ``FileNotFoundError`` is the one I/O error that passes it over."""
    original = CheckpointManager._load

    def pruned_first(self: CheckpointManager, path: Path, *args: Any) -> Any:
        if path == self.path(2):
            os.unlink(path)
        return original(self, path, *args)

    monkeypatch.setattr(CheckpointManager, "_load", pruned_first)
    result, caught = _restore(manager, _targets())
    assert not isinstance(result, BaseException), result
    assert result[0] == 1 and [w.category for w in caught] == [SkippedCheckpointWarning]
    assert "No such file" in str(caught[0].message)


def test_eio_while_pruning_keeps_the_completed_save(tmp_path: Path, config: gdsckpt.Config,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO reading an older checkpoint while the prune after a save decides what to keep: the save
    (file and ``latest``, both already published) is reported complete, a warning says pruning was
    skipped, nothing is deleted, and the next save prunes."""
    manager = CheckpointManager(tmp_path / "run", keep_last=1, config=config)
    manager.save(1, state_for(1, ELEMENTS), codec="zstd")
    data = manager.path(1).read_bytes()
    index_offset = unpack_trailer(data[-64:], len(data)).index_offset
    with monkeypatch.context() as m:
        fault = Fault("preadv", _reads_at(index_offset, inode=manager.path(1).stat().st_ino), errno.EIO).install(m)
        with pytest.warns(RuntimeWarning, match=r"step 2 is saved, but pruning .* skipped: OSError"):
            report = manager.save(2, state_for(2, ELEMENTS), codec="zstd")
    assert fault.raised >= 1 and report.path == str(manager.path(2))
    assert manager.path(1).is_file() and manager.latest_step() == 2
    manager.save(3, state_for(3, ELEMENTS), codec="zstd")
    assert manager.steps() == [3]
