"""The null sink and the null source: a save into ``NullWriter`` and a restore from
``PreloadedReader`` run the whole pipeline without storage, and say so."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt.errors import CorruptCheckpointError
from gdsckpt.io import NullWriter, PreloadedReader


def _state() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {"w": torch.randn(300_000, generator=generator).bfloat16(),
            "m": torch.randn(70_000, generator=generator),
            "step": 7, "small": [torch.arange(5)]}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.view(torch.uint8).equal(b.view(torch.uint8))


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_save_into_the_null_sink_counts_the_bytes_and_keeps_nothing(tmp_path: Path, codec: str) -> None:
    sink = NullWriter()
    report = gdsckpt.save(_state(), sink, codec=codec)
    assert report.path == "<null>" and report.backend == "null"
    assert sink.bytes_written == report.file_bytes > 0
    # The same bytes a file would have held.
    file_report = gdsckpt.save(_state(), tmp_path / "x.gdsckpt", codec=codec)
    assert file_report.file_bytes == report.file_bytes


def test_a_delta_into_a_storage_writer_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "base.gdsckpt"
    gdsckpt.save(_state(), base)
    with pytest.raises(ValueError, match="needs a file path"):
        gdsckpt.save(_state(), NullWriter(), base=base)


def test_restores_from_the_null_source_are_bit_exact_and_repeatable(tmp_path: Path) -> None:
    path = tmp_path / "x.gdsckpt"
    state = _state()
    gdsckpt.save(state, path, codec="zstd")
    for source in (path, path.read_bytes()):
        reader = PreloadedReader(source)
        for _ in range(2):  # a load closes its reader; the null source serves the next one too
            got = gdsckpt.load(reader)
            assert _same(got["w"], state["w"]) and _same(got["m"], state["m"])
            assert got["step"] == 7 and _same(got["small"][0], state["small"][0])
        assert gdsckpt.load(reader, keys=["m"]).keys() == {"m"}


def test_the_null_source_refuses_reads_past_its_end_and_damage_still_shows(tmp_path: Path) -> None:
    path = tmp_path / "x.gdsckpt"
    gdsckpt.save(_state(), path, codec="none")
    data = bytearray(path.read_bytes())
    reader = PreloadedReader(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="past the end"):
        reader.read(reader.size - 4, 8)
    with pytest.raises(CorruptCheckpointError, match="past the end"):
        reader.submit_read(reader.size - 4, np.empty(8, dtype=np.uint8))
    data[4096 + 10] ^= 0xFF  # a byte of the first chunk
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        gdsckpt.load(PreloadedReader(bytes(data)))


def test_the_null_source_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    """``PreloadedReader(fifo)`` opened it with a blocking ``open`` and waited for ever for a
    writer; the other readers refuse such a path as not a regular file."""
    fifo = tmp_path / "x.gdsckpt"
    os.mkfifo(fifo)
    with pytest.raises(gdsckpt.errors.UnsupportedFormatError, match="is a FIFO, not a regular file"):
        PreloadedReader(fifo)
