"""Adversarial cases of the GPU restore driver (``pipeline.load._stream_chunks``) and the GPU
decoder, run on the fake device (tests/fake_device.py) with real files: memory bounds, reads that
fail or land late, timeouts, decoders reused across restores. See tests/test_grouped_reads.py for
the helpers and the cases already covered there."""

from __future__ import annotations

import functools
import gc
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_device import FakeDevice
from test_fake_device import TIMEOUT
from test_grouped_reads import (
    PIECE,
    RecordingReader,
    assert_same,
    big_state,
    chunk_inside_a_group,
    grouped_decoder,
    lead_decoder,
    lead_of,
    restore,
    saved_file,
)

import gdsckpt
from gdsckpt.config import Config
from gdsckpt.errors import CorruptCheckpointError
from gdsckpt.format import align_up
from gdsckpt.io.posix import PosixReader, PosixWriter
from gdsckpt.pipeline.gpu import GpuDecoder, GpuEncoder
from gdsckpt.pipeline.gpu.staging import (
    GROUP_READ_SHARE,
    STAGING_RING_SHARE,
    decode_scratch,
    lead_read_pieces,
    slots_that_fit,
)
from gdsckpt.pipeline.load import open_file, run_restore
from gdsckpt.state import NumpyTarget

pytestmark = pytest.mark.usefixtures("nvcomp_scratch_at_fake_scale")

MIB = 1 << 20


def _targets(flat: object) -> dict[int, NumpyTarget]:
    return {i: NumpyTarget(a.shape, a.dtype) for i, a in enumerate(flat.arrays)}  # type: ignore[attr-defined]


# -- memory bounds ------------------------------------------------------------------------------

@pytest.mark.parametrize("staging", [2 << 20, GROUP_READ_SHARE * 4 * PIECE])
def test_a_decoder_reused_across_restores_stays_within_its_staging_budget(tmp_path: Path, staging: int) -> None:
    """``Checkpoint._window_restorer`` keeps one GpuDecoder for every window restore of a file
    (rebase, convert, a delta's base reads). Each restore's ``reserve_reads`` drops the previous
    ring and arena and allocates new ones, so device memory stays within the budget only if
    nothing still holds views of the previous ones: the decoder's idle worker thread
    (``BatchWorker._run``) once kept its last batch, whose ``DecodeJob.stored`` views kept the
    previous restore's ring (or arena) allocated while the next ring was made."""
    state = big_state(40)
    path, flat = saved_file(tmp_path, state, codec="ans")  # no decode scratch: the ring fills the budget
    device = FakeDevice()
    dec = grouped_decoder(device, staging=staging)
    try:
        with PosixReader(path) as reader:
            index = open_file(reader).index
            for _round in range(2):
                run_restore(reader, index, dec, _targets(flat), max_inflight_bytes=1 << 30, timeout=TIMEOUT)
                assert dec.staging_bytes <= staging
    finally:
        dec.close()
    assert device.peak_bytes <= staging, (device.peak_bytes, staging)


def test_a_finished_restore_leaves_nothing_but_the_decoders_own_staging(tmp_path: Path) -> None:
    """The same retention seen directly: once a restore has returned and the decoder's ring and
    arena are released, no device memory stays allocated (the idle worker's last batch kept part
    of it)."""
    state = big_state(41)
    path, flat = saved_file(tmp_path, state, codec="zstd")
    device = FakeDevice()
    dec = grouped_decoder(device)
    try:
        with PosixReader(path) as reader:
            run_restore(reader, open_file(reader).index, dec, _targets(flat), max_inflight_bytes=1 << 30,
                        timeout=TIMEOUT)
        dec._drop_staging()  # what the next restore's reserve_reads does first
        time.sleep(0.2)  # the worker is idle, waiting for its next job
        gc.collect()
        assert device.live_bytes == 0, device.live_bytes
    finally:
        dec.close()


@pytest.mark.parametrize("codec", ["ans", "zstd"])
def test_a_budget_that_holds_one_slot_restores_within_it_and_one_that_holds_none_is_refused(
        tmp_path: Path, codec: str) -> None:
    """The file's chunks set a slot's size, which a restore cannot shrink. A budget with room for
    one slot (with nvCOMP's decode scratch) restores through that one, bit-exact, within the
    budget; a budget with room for none is a ``ValueError`` naming the least that would do, and
    that budget restores. Before, a restore took two slots whatever its budget, and exceeded it."""
    state = big_state(42)
    path, flat = saved_file(tmp_path, state, codec=codec)
    with PosixReader(path) as reader:
        index = open_file(reader).index
    largest_raw = align_up(max(c.raw for c in index.chunks))
    slot = max(align_up(max(c.stored for c in index.chunks)), largest_raw) + largest_raw
    fixed, per_slot = decode_scratch([index.chains[c.chain][-1]["name"] for c in index.chunks], largest_raw)
    one = math.ceil((fixed + slot + per_slot) / STAGING_RING_SHARE)
    assert slots_that_fit(one, slot, (fixed, per_slot)) == 1
    for staging in (one, one + slot // 2):
        device = FakeDevice()
        dec = grouped_decoder(device, staging=staging)
        with PosixReader(path) as reader:
            got = restore(reader, flat, dec)
        assert_same(got, state)
        assert device.peak_bytes <= staging, (device.peak_bytes, staging)
    device = FakeDevice()
    dec = grouped_decoder(device, staging=one - 1)
    with PosixReader(path) as reader, pytest.raises(ValueError, match=f"at least {one}"):
        restore(reader, flat, dec)
    assert device.peak_bytes == 0


# -- errors name the chunk ----------------------------------------------------------------------

class SizeCheckingReader(PosixReader):
    """A POSIX reader that refuses, when the call is made, a read running past the file's end, as
    ``KvikioReader.submit_read`` does for device buffers (gdsckpt/io/kvikio.py: ``offset +
    out.nbytes > self.size`` raises ``CorruptCheckpointError`` before any future exists)."""

    def submit_read(self, offset: int, out: np.ndarray):  # type: ignore[override]
        if offset + out.nbytes > self.size:
            raise CorruptCheckpointError(f"range [{offset}, +{out.nbytes}) runs past the end of the file")
        return super().submit_read(offset, out)


def test_a_file_cut_inside_a_group_names_its_chunk_with_a_reader_that_refuses_at_submit(tmp_path: Path) -> None:
    """The file is cut half-way through a chunk in the middle of a group after its index was read
    (the data reader is opened after the index, as ``open_data_reader`` opens kvikio's). With the
    POSIX reader the grouped call fails through its future, its chunks are read again one by one
    and the error names the cut chunk (test_grouped_reads). A reader that refuses the range when
    the call is made (kvikio) must be handled the same way: its refusal becomes that read's
    failure (``pipeline.load._submit_read``), not an error of the whole restore naming no chunk."""
    state = big_state(9)
    path, flat = saved_file(tmp_path, state, codec="zstd")
    index, cut = chunk_inside_a_group(path, flat)
    record = index.chunks[cut]
    os.truncate(path, record.offset + record.stored // 2)
    dec = grouped_decoder(FakeDevice())
    with SizeCheckingReader(path) as reader:
        try:
            with pytest.raises(CorruptCheckpointError) as caught:
                run_restore(reader, index, dec, _targets(flat), max_inflight_bytes=1 << 30, timeout=TIMEOUT)
        finally:
            dec.close()
    assert caught.value.chunk == cut, str(caught.value)


# -- a combination covered nowhere else ----------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_a_window_across_the_lead_end_with_a_failed_lead_piece_restores_within_bounds(tmp_path: Path,
                                                                                       seed: int) -> None:
    """A partial restore (some arrays, a window of one that starts inside the lead and ends past
    it), reads landing late and out of order, the lead's second piece failing once: bit-exact,
    no read into memory a running read fills, and device memory within the budget."""
    state = big_state(80 + seed)
    path, flat = saved_file(tmp_path, state, codec="zstd")
    keys = [a.key for a in flat.arrays]
    big = keys.index("big")
    ids = [big, keys.index("w16"), keys.index("steps")]
    window = {big: (4 * 1000 + 4 * seed, state["big"].nbytes - 4 * 777)}
    staging = GROUP_READ_SHARE * 3 * PIECE
    with RecordingReader(path, seed=seed, fail_at=1, slow=(0,)) as reader:
        device = FakeDevice()
        lead = lead_of(reader, device, lead_read_pieces(staging, PIECE) * PIECE)
        dec = lead_decoder(device, lead, staging=staging)
        got = restore(reader, flat, dec, windows=window, ids=ids)
        lead.close()
        assert not reader.overlaps, reader.overlaps
    start, stop = window[big]
    assert got["big"].tobytes() == state["big"].tobytes()[start:stop]
    for key in ("w16", "steps"):
        assert got[key].tobytes() == state[key].tobytes()
    assert device.peak_bytes <= staging, (device.peak_bytes, staging)


# -- the public API on the fake device ------------------------------------------------------------

class _PosixAsKvikioReader(PosixReader):
    """``KvikioReader``'s constructor over a POSIX reader: the fake device's "device" buffers are
    NumPy arrays, which the POSIX reader fills."""

    def __init__(self, path: Any, *, threads: int = 4, task_size: int | None = None, timeout: float = 60.0):
        super().__init__(path, threads=threads, timeout=timeout)


class _PosixAsKvikioWriter(PosixWriter):
    """``KvikioWriter``'s constructor over a POSIX writer (see ``_PosixAsKvikioReader``)."""

    def __init__(self, target: Any, *, threads: int = 4, task_size: int | None = None,
                 o_direct: bool | str = "auto", fsync: bool = True, timeout: float = 60.0):
        super().__init__(target, threads=threads, o_direct=o_direct, fsync=fsync, timeout=timeout)


def fake_gpu(monkeypatch: pytest.MonkeyPatch, encode: FakeDevice, decode: FakeDevice) -> None:
    """Make the public save and load run the GPU engine on fake devices: every ``GpuEncoder`` on
    ``encode``, every ``GpuDecoder`` on ``decode``, kvikio's reader and writer on POSIX files."""
    import gdsckpt.codecs.nvcomp as nvcomp
    import gdsckpt.io.kvikio as kvikio_module
    import gdsckpt.pipeline.gpu as gpu_package

    monkeypatch.setattr(nvcomp, "gpu_available", lambda: True)
    monkeypatch.setattr(gpu_package, "GpuEncoder", functools.partial(GpuEncoder, device=encode))
    monkeypatch.setattr(gpu_package, "GpuDecoder", functools.partial(GpuDecoder, device=decode))
    monkeypatch.setattr(kvikio_module, "KvikioReader", _PosixAsKvikioReader)
    monkeypatch.setattr(kvikio_module, "KvikioWriter", _PosixAsKvikioWriter)


def _restored_within_the_least_budget(path: Path, want: dict[str, np.ndarray],
                                       monkeypatch: pytest.MonkeyPatch, **load: Any) -> int:
    """Load ``path`` on a fake GPU under ever larger restore budgets, each the least the previous
    refusal named, until it restores; check it is bit-exact and that the device never held more
    than that budget; return the budget."""
    budget = 4096
    for _attempt in range(4):
        device = FakeDevice()
        fake_gpu(monkeypatch, FakeDevice(), device)
        config = Config(restore_staging_bytes=budget)
        try:
            if "rows" in load:
                key, start, stop = load["rows"]
                with gdsckpt.open(path, config=config) as checkpoint:
                    got = {key: checkpoint.get_rows(key, start, stop)}
            else:
                got = gdsckpt.load(path, config=config)
        except ValueError as refused:
            found = re.search(r"holds no slot.*at least (\d+)", str(refused))
            assert found is not None, refused
            assert int(found.group(1)) > budget, "the least budget named is not above the one refused"
            budget = int(found.group(1))
            continue
        assert all(got[key].tobytes() == value.tobytes() for key, value in want.items())
        assert device.peak_bytes > 0  # ANS chunks: decoded on the (fake) GPU
        assert device.peak_bytes <= budget, (
            f"a delta restore held {device.peak_bytes} bytes of device staging under restore_staging_bytes={budget}")
        return budget
    raise AssertionError("no budget the refusals named restored the file")


def test_a_delta_restore_stays_within_its_restore_staging_budget(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``restore_staging_bytes`` bounds a GPU restore's staging, however small (a budget with room
    for one slot restores through one). A delta's XORs read its base through the base
    ``Checkpoint``'s own decoder, alive beside the delta's: each had a ring sized to the whole
    budget, so a delta restored under the least budget its refusal named held about twice it
    (262,144 bytes under 145,636), and a chain of two deltas three times. The decoders now split
    the budget (the delta's half, its base's half, halved again by a base of its own): a load, a
    chain of two, and ``gdsckpt.open(...).get_rows`` of a delta stay within the budget, and the
    least budget a refusal names restores (a deeper decoder may name a larger one next)."""
    state_a = {"w": (np.random.default_rng(1).standard_normal(300_000) * 0.02).astype(np.float32),
               "v": np.random.default_rng(2).standard_normal(200_000).astype(np.float32)}
    state_b = {key: value.copy() for key, value in state_a.items()}
    state_b["w"][::100] += 1
    state_c = {key: value.copy() for key, value in state_b.items()}
    state_c["v"][::70] -= 1
    fake_gpu(monkeypatch, FakeDevice(), FakeDevice())
    saving = Config(engine="gpu", gpu_chunk_bytes=64 << 10, max_staging_bytes=64 * MIB)
    gdsckpt.save(state_a, tmp_path / "a.gdsckpt", codec="ans", config=saving)
    report = gdsckpt.save(state_b, tmp_path / "b.gdsckpt", codec="ans", config=saving, base=tmp_path / "a.gdsckpt")
    assert report.delta_tensors == 2 and report.engine == "gpu"
    gdsckpt.save(state_c, tmp_path / "c.gdsckpt", codec="ans", config=saving, base=tmp_path / "b.gdsckpt")

    one_link = _restored_within_the_least_budget(tmp_path / "b.gdsckpt", state_b, monkeypatch)
    two_links = _restored_within_the_least_budget(tmp_path / "c.gdsckpt", state_c, monkeypatch)
    assert two_links > one_link  # its deepest decoder has a quarter of the budget
    rows = {"w": state_c["w"].reshape(-1)[1000:50_000]}
    _restored_within_the_least_budget(tmp_path / "c.gdsckpt", rows, monkeypatch, rows=("w", 1000, 50_000))


def test_an_open_delta_gives_its_bases_staging_back_between_reads(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``gdsckpt.open`` of a delta keeps its base open, and the base keeps the decoder its window
    reads go through (``Checkpoint._window_restorer``): that decoder held its ring after each read.
    A later ``get`` of an array stored whole sized its own decoder from the whole restore budget
    beside it: 2,752,512 bytes of device memory under ``restore_staging_bytes`` of 2 MiB. A kept
    decoder now gives its staging back after each restore: every read stays within the budget,
    bit-exact, and nothing is left allocated between reads."""
    rng = np.random.default_rng(1)
    state_a = {"w": (rng.standard_normal(300_000) * 0.02).astype(np.float32)}
    state_b = {"w": state_a["w"].copy(), "new": rng.standard_normal(300_000).astype(np.float32)}
    state_b["w"][::100] += 1
    fake_gpu(monkeypatch, FakeDevice(), FakeDevice())
    saving = Config(engine="gpu", gpu_chunk_bytes=64 << 10, max_staging_bytes=64 * MIB)
    gdsckpt.save(state_a, tmp_path / "a.gdsckpt", codec="ans", config=saving)
    report = gdsckpt.save(state_b, tmp_path / "b.gdsckpt", codec="ans", config=saving, base=tmp_path / "a.gdsckpt")
    assert report.delta_tensors == 1
    budget = 2 * MIB
    device = FakeDevice()
    fake_gpu(monkeypatch, FakeDevice(), device)
    with gdsckpt.open(tmp_path / "b.gdsckpt", config=Config(restore_staging_bytes=budget)) as checkpoint:
        for key in ("w", "new", "w", "new"):
            assert checkpoint.get(key).tobytes() == state_b[key].tobytes()
            gc.collect()
            assert device.live_bytes == 0, f"{device.live_bytes} bytes of staging kept after get({key!r})"
        rows = checkpoint.get_rows("w", 1000, 2000)
        assert rows.tobytes() == state_b["w"][1000:2000].tobytes()
    assert 0 < device.peak_bytes <= budget, (device.peak_bytes, budget)


def test_a_portable_delta_on_a_gpu_only_base_is_written_in_full(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``save(..., base=a, portable=True)`` with ``a`` written in nvCOMP's ANS (only a GPU decodes
    it): the delta's own chunks were portable, but loading it decodes its base, so the file could
    not be read on a machine without a GPU (``CodecUnavailableError``), though ``portable``
    promises one any machine reads. Such a save now writes a full checkpoint, which the CPU engine
    loads bit-exact; a portable base still gets a delta."""
    rng = np.random.default_rng(4)
    state_a = {"w": (rng.standard_normal(300_000) * 0.02).astype(np.float32)}
    state_b = {"w": state_a["w"].copy()}
    state_b["w"][::7] += 1
    fake_gpu(monkeypatch, FakeDevice(), FakeDevice())
    config = Config(engine="gpu", gpu_chunk_bytes=64 << 10, max_staging_bytes=64 * MIB)
    gdsckpt.save(state_a, tmp_path / "a.gdsckpt", codec="ans", config=config)
    report = gdsckpt.save(state_b, tmp_path / "b.gdsckpt", config=config, base=tmp_path / "a.gdsckpt", portable=True)
    assert report.base is None and report.delta_tensors == 0
    gdsckpt.save(state_a, tmp_path / "p.gdsckpt", codec="lz4", config=config)
    on_portable = gdsckpt.save(state_b, tmp_path / "c.gdsckpt", config=config, base=tmp_path / "p.gdsckpt",
                               portable=True)
    assert on_portable.base is not None and on_portable.delta_tensors == 1
    monkeypatch.undo()
    for name in ("b.gdsckpt", "c.gdsckpt"):
        assert gdsckpt.inspect(tmp_path / name).portable
        assert gdsckpt.load(tmp_path / name, config=Config(engine="cpu"))["w"].tobytes() == state_b["w"].tobytes()
