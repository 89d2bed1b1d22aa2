"""The GPU encoder and decoder, driven through a NumPy stand-in for the device (``fake_device``):
their own logic (staging ring, batching, byte-plane decisions, fallbacks, error handling) runs
here without a GPU. The device calls themselves (nvCOMP, the CRC kernel, CuPy copies) are checked
by ``tests/gpu`` on a GPU host."""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
from fake_device import FAKE_MARKER, FakeDevice

from gdsckpt.api.saving import index_template
from gdsckpt.codecs import Chain
from gdsckpt.errors import CorruptCheckpointError
from gdsckpt.format import ALIGNMENT, checksum
from gdsckpt.format.index import ChunkRecord, Index
from gdsckpt.io.memory import MemoryReader, MemoryStore, MemoryWriter
from gdsckpt.pipeline.autotune import sample_ratios_on
from gdsckpt.pipeline.engine import HostEngine
from gdsckpt.pipeline.gpu import GpuDecoder, GpuEncoder, RoundedArraySource
from gdsckpt.pipeline.gpu.decoder import DecodeJob
from gdsckpt.pipeline.gpu.staging import ENCODE_SCRATCH, STAGING_RING_SHARE
from gdsckpt.pipeline.load import DeferredTargets, open_file, run_restore
from gdsckpt.pipeline.plan import ChunkPlan, Part, plan_chunks
from gdsckpt.pipeline.save import run_save
from gdsckpt.state import NumpyTarget, flatten

pytestmark = pytest.mark.usefixtures("nvcomp_scratch_at_fake_scale")

KIB = 1 << 10
CHUNK = 64 * KIB
TIMEOUT = 30.0


class DeviceSource:
    """A NumPy-backed source the encoder takes for device memory (the fake's "device" arrays)."""

    def __init__(self, source: Any):
        self.source = source
        self.nbytes, self.itemsize, self.plane_width = source.nbytes, source.itemsize, source.plane_width
        self.on_device = True

    def host_bytes(self, start: int, stop: int) -> np.ndarray:
        return self.source.host_bytes(start, stop)

    def device_bytes(self, start: int, stop: int) -> np.ndarray:
        return self.source.host_bytes(start, stop)

    def device_span(self, start: int, stop: int) -> int | None:
        """The "device" address of a contiguous range (the gather kernel's input), as a CUDA
        tensor's source gives one."""
        array = getattr(self.source, "array", None)
        if array is None or not array.flags.c_contiguous:
            return None
        return int(array.ctypes.data) + start


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Float-like state (compressible in the high bytes), a small packed tensor, and noise."""
    rng = np.random.default_rng(seed)
    return {
        "w32": (rng.standard_normal(50_000) * 0.02).astype(np.float32),
        "w16": (rng.standard_normal((300, 129)) * 0.02).astype(np.float16),
        "steps": np.arange(37, dtype=np.int64),
        "noise": rng.integers(0, 256, 70_000, dtype=np.uint8),
        "zeros": np.zeros(40_000, dtype=np.float32),
    }


def save_through(device: FakeDevice, state: dict[str, np.ndarray], *, codec: str = "ans",
                 byte_planes: str = "auto", on_device: bool = True, staging: int = 64 << 20,
                 batch_chunks: int = 64, chunk_bytes: int = CHUNK,
                 fit_chunk: bool = False) -> tuple[MemoryStore, Any, GpuEncoder]:
    """Save ``state`` through a ``GpuEncoder`` on ``device`` into memory. The chunks are planned
    after the encoder is made, with the chunk size it took (``fit_chunk``: as ``gdsckpt.save``
    lets it fit its chunks to the budget)."""
    flat = flatten(state)
    sources = [DeviceSource(a.source) if on_device else a.source for a in flat.arrays]
    encoder = GpuEncoder(sources, codec=codec, byte_planes=byte_planes, device_id=0, chunk_bytes=chunk_bytes,
                         max_staging_bytes=staging, batch_chunks=batch_chunks, timeout=TIMEOUT, device=device,
                         fit_chunk=fit_chunk)
    plans = plan_chunks([(s.nbytes, s.itemsize, s.plane_width) for s in sources], chunk_bytes=encoder.chunk_bytes,
                        pack_below=encoder.chunk_bytes // 4)
    store = MemoryStore()

    try:
        run_save(plans, encoder, MemoryWriter(store, "ckpt"), max_inflight_bytes=1 << 30, index=index_template(flat),
                 timeout=TIMEOUT)
    finally:
        encoder.close()
    return store, flat, encoder


def restore_through(decoder: Any, store: MemoryStore, flat: Any) -> dict[str, np.ndarray]:
    reader = MemoryReader(store, "ckpt")
    index = open_file(reader).index
    targets = {i: NumpyTarget(a.shape, a.dtype) for i, a in enumerate(flat.arrays)}
    try:
        run_restore(reader, index, decoder, targets, max_inflight_bytes=1 << 30, timeout=TIMEOUT)
    finally:
        decoder.close()
    return {a.key: targets[i].finish() for i, a in enumerate(flat.arrays)}


def chains_of(store: MemoryStore) -> list[list[dict[str, Any]]]:
    return open_file(MemoryReader(store, "ckpt")).index.chains


def decoder(device: FakeDevice, staging: int = 64 << 20, batch_chunks: int = 64) -> GpuDecoder:
    return GpuDecoder(device_id=0, max_staging_bytes=staging, restore_staging_bytes=staging,
                      batch_chunks=batch_chunks, timeout=TIMEOUT, device=device)


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for key, array in want.items():
        assert got[key].dtype == array.dtype and got[key].shape == array.shape, key
        assert got[key].tobytes() == array.tobytes(), key


# -- round trips --------------------------------------------------------------------------------

@pytest.mark.parametrize("codec", ["ans", "zstd", "lz4", "deflate", "bitcomp", "none"])
@pytest.mark.parametrize("on_device", [True, False])
def test_save_and_restore_round_trip_bit_exact(codec: str, on_device: bool) -> None:
    state = weights()
    store, flat, _ = save_through(FakeDevice(), state, codec=codec, on_device=on_device)
    assert_same(restore_through(decoder(FakeDevice()), store, flat), state)


def test_portable_bitstreams_cross_between_the_fake_gpu_and_the_cpu_engine() -> None:
    """The fake writes real zstd frames for ``zstd``: the CPU engine reads what the GPU encoder
    wrote, and the GPU decoder reads what the CPU engine wrote (byte planes included)."""
    state = weights(1)
    store, flat, _ = save_through(FakeDevice(), state, codec="zstd", byte_planes="always")
    assert any(chain[0]["name"] == "byteplanes/1" for chain in chains_of(store))
    assert_same(restore_through(HostEngine([], codec="none", byte_planes="never", threads=2), store, flat), state)


class DeviceMemoryTarget(NumpyTarget):
    """A destination in the fake's "device" memory (host memory: its pointers are the fake's
    device addresses) on CUDA device ``device``, which the decoder may write itself
    (``device_address``); ``calls`` counts the bytes handed to it through ``write_*`` instead."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, device: int = 0):
        super().__init__(shape, np.dtype(dtype).name)
        self.device = device
        self.delivered = 0

    def device_address(self, start: int) -> tuple[int, int] | None:
        return (self.device, int(self._flat.ctypes.data) + start) if self.nbytes else None

    def write_device(self, start: int, data: Any) -> None:
        self.delivered += data.nbytes
        super().write_device(start, data)

    def write_host(self, start: int, data: np.ndarray) -> None:
        self.delivered += data.nbytes
        super().write_host(start, data)


def restore_into(device: FakeDevice, store: MemoryStore, flat: Any,
                 make_target: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    reader = MemoryReader(store, "ckpt")
    index = open_file(reader).index
    targets = {i: make_target(a) for i, a in enumerate(flat.arrays)}
    dec = decoder(device)
    try:
        run_restore(reader, index, dec, targets, max_inflight_bytes=1 << 30, timeout=TIMEOUT)
    finally:
        dec.close()
    return ({a.key: targets[i].finish() for i, a in enumerate(flat.arrays)},
            {a.key: targets[i] for i, a in enumerate(flat.arrays)})


@pytest.mark.parametrize("codec", ["ans", "zstd", "none"])
@pytest.mark.parametrize("byte_planes", ["auto", "never"])
def test_decoder_writes_device_destinations_itself_bit_exact(codec: str, byte_planes: str) -> None:
    """Every destination in the decoder's device memory: the decoder writes each chunk there
    (byte planes undone straight into a destination that takes a whole chunk, copies into the
    packed ones) and hands nothing to ``write_device``."""
    state = weights(4)
    store, flat, _ = save_through(FakeDevice(), state, codec=codec, byte_planes=byte_planes)
    device = FakeDevice()
    got, targets = restore_into(device, store, flat, lambda a: DeviceMemoryTarget(a.shape, a.dtype))
    assert_same(got, state)
    assert all(target.delivered == 0 for target in targets.values())
    operations = {call[0] for call in device.calls}
    assert "copy_out" in operations  # the packed small arrays
    planed = any(chain[0]["name"] == "byteplanes/1" for chain in chains_of(store))
    assert ("planes_inverse_to" in operations) == planed


def test_chunks_with_a_destination_elsewhere_are_delivered_whole_through_the_callback() -> None:
    """A chunk is placed only when every destination of it is on the decoder's device: a packed
    chunk shared with an ordinary target, and one whose array is on another device, go through
    ``write_device`` whole; the other chunks are written in place; all bit-exact."""
    rng = np.random.default_rng(5)
    state = {**weights(5), "a": rng.standard_normal(100).astype(np.float32),
             "b": rng.standard_normal(50).astype(np.float32)}
    store, flat, _ = save_through(FakeDevice(), state, codec="ans", byte_planes="always")
    index = open_file(MemoryReader(store, "ckpt")).index
    chunk_of = {record.key: {segment.chunk for segment in record.segments} for record in index.tensors}
    assert chunk_of["a"] == chunk_of["b"]  # packed together

    def make(array: Any) -> Any:
        if array.key == "steps":
            return DeviceMemoryTarget(array.shape, array.dtype, device=1)
        if array.key == "b":
            return NumpyTarget(array.shape, np.dtype(array.dtype).name)
        return DeviceMemoryTarget(array.shape, array.dtype)

    got, targets = restore_into(FakeDevice(), store, flat, make)
    assert_same(got, state)
    assert targets["steps"].delivered == state["steps"].nbytes
    assert targets["a"].delivered == state["a"].nbytes  # its chunk holds "b" too
    assert targets["w32"].delivered == 0 and targets["zeros"].delivered == 0


def test_damaged_chunk_with_device_destinations_is_corruption() -> None:
    state = weights(6)
    store, flat, _ = save_through(FakeDevice(), state, codec="ans")
    blob = bytearray(store.get("ckpt"))
    first = open_file(MemoryReader(store, "ckpt")).index.chunks[0]
    blob[first.offset + first.stored // 2] ^= 0x40
    store.put("ckpt", bytes(blob))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        restore_into(FakeDevice(), store, flat, lambda a: DeviceMemoryTarget(a.shape, a.dtype))


def test_gpu_only_streams_are_marked_fake() -> None:
    store, _flat, _ = save_through(FakeDevice(), weights(), codec="ans")
    blob = store.get("ckpt")
    assert FAKE_MARKER in blob
    assert any(chain[-1]["name"] == "nvcomp.ans/1" for chain in chains_of(store))


# -- ring and batching --------------------------------------------------------------------------

def test_encoder_ring_is_bounded_by_the_staging_budget_and_its_slots_are_reused() -> None:
    device = FakeDevice()
    state = {"big": (np.random.default_rng(2).standard_normal(400_000) * 0.02).astype(np.float32)}  # 25 chunks
    budget = 700 * KIB
    store, flat, encoder = save_through(device, state, codec="ans", staging=budget)
    assert encoder.ring is not None and encoder.max_pending == encoder.ring.slots
    assert 2 <= encoder.ring.slots < 25  # far fewer slots than chunks: slots were reused
    assert encoder.ring.nbytes <= budget
    assert encoder.ring.free_slots() == encoder.ring.slots  # every slot came back
    assert_same(restore_through(decoder(FakeDevice()), store, flat), state)


@pytest.mark.parametrize("codec", ["zstd", "lz4", "deflate", "bitcomp", "ans", "none"])
def test_a_gpu_save_fits_its_chunks_to_the_staging_budget(codec: str) -> None:
    """Everything the encoder holds at once (ring, nvCOMP's scratch as ``ENCODE_SCRATCH`` scales it,
    the byte-plane trial's buffer: the fake device's peak of live allocations) stays within
    ``max_staging_bytes``: where two slots of the chunk size asked for do not fit with the
    codec's scratch, the chunks shrink until they do, and the file reads back bit-exact."""
    rng = np.random.default_rng(5)
    state = {"w": (rng.standard_normal(600_000) * 0.02).astype(np.float32), "n": rng.integers(0, 256, 90_000,
                                                                                               dtype=np.uint8)}
    asked = 16 * CHUNK  # 1 MiB: nvCOMP Deflate's scratch for it is 9 MiB a chunk, Zstd's 1.5 MiB
    fixed = math.ceil(ENCODE_SCRATCH.get(codec, (0, 0))[0] / STAGING_RING_SHARE)  # its scratch whatever the chunk
    for staging in (fixed + (8 << 20), fixed + (24 << 20), fixed + (96 << 20)):
        device = FakeDevice()
        store, flat, encoder = save_through(device, state, codec=codec, staging=staging, chunk_bytes=asked,
                                            fit_chunk=True)
        assert device.peak_bytes <= staging, (codec, staging, device.peak_bytes, encoder.chunk_bytes)
        assert encoder.chunk_bytes <= asked and encoder.ring is not None and encoder.ring.slots >= 2
        chunks = open_file(MemoryReader(store, "ckpt")).index.chunks
        assert max(c.raw for c in chunks) <= encoder.chunk_bytes
        assert_same(restore_through(decoder(FakeDevice()), store, flat), state)
    # the chunk size asked for is kept wherever it fits
    _store, _flat, roomy = save_through(FakeDevice(), state, codec=codec, staging=fixed + (1 << 30), chunk_bytes=asked,
                                        fit_chunk=True)
    assert roomy.chunk_bytes == asked


def test_zstd_is_refused_under_the_default_budget_and_its_chunks_shrink_where_that_fits() -> None:
    """nvCOMP Zstd holds about 1.1 GiB of scratch whatever the chunk size: under the default 1 GiB
    budget no chunk size fits, so the encoder refuses with a ValueError naming the least budget
    that would do. A budget that holds the scratch and two 8 MiB slots but not two of 16 MiB gets
    8 MiB chunks."""
    from gdsckpt.codecs.nvcomp import MAX_CHUNK_BYTES
    from gdsckpt.pipeline.gpu.encoder import MIN_FITTED_CHUNK_BYTES

    source = [DeviceSource(flatten({"w": np.zeros(16 << 20, np.float32)}).arrays[0].source)]  # 8 chunks of 8 MiB
    with pytest.raises(ValueError, match=r"max_staging_bytes=1073741824 cannot hold two staging slots.*needs at least"):
        GpuEncoder(source, codec="zstd", byte_planes="auto", device_id=0, chunk_bytes=MAX_CHUNK_BYTES,
                   max_staging_bytes=1 << 30, device=FakeDevice(), fit_chunk=True)
    fixed, per_chunk = ENCODE_SCRATCH["zstd"]
    halves = fixed + 3 * (2 * (8 << 20) + per_chunk // 2)  # three 8 MiB slots, under two of 16 MiB
    assert halves < fixed + 2 * (2 * MAX_CHUNK_BYTES + per_chunk)
    budget = math.ceil(halves / STAGING_RING_SHARE)
    device = FakeDevice()
    encoder = GpuEncoder(source, codec="zstd", byte_planes="auto", device_id=0, chunk_bytes=MAX_CHUNK_BYTES,
                         max_staging_bytes=budget, device=device, fit_chunk=True)
    assert encoder.chunk_bytes == 8 << 20 and encoder.staging_bytes <= budget
    assert encoder.ring is not None and encoder.ring.slots >= 2
    encoder.close()
    # without fit_chunk (chunks planned already) the size stays and the ring keeps two slots
    kept = GpuEncoder(source, codec="zstd", byte_planes="auto", device_id=0, chunk_bytes=MIN_FITTED_CHUNK_BYTES * 4,
                      max_staging_bytes=1 << 20, device=FakeDevice())
    assert kept.chunk_bytes == MIN_FITTED_CHUNK_BYTES * 4 and kept.ring is not None and kept.ring.slots == 2
    kept.close()


def test_a_small_state_takes_no_more_slots_than_it_can_have_chunks() -> None:
    """The ring holds at most one slot per chunk the sources can make (each array's own chunks;
    packing only makes fewer): three small arrays under the default 1 GiB budget take three
    slots, not the ~27 of 32 MiB the budget holds."""
    state = {"a": np.ones(1000, np.float32), "b": np.ones(5, np.int64), "c": np.zeros(300_000, np.float32)}
    device = FakeDevice()
    store, flat, encoder = save_through(device, state, codec="ans", staging=1 << 30, chunk_bytes=16 << 20,
                                        fit_chunk=True)
    assert encoder.ring is not None and encoder.ring.slots == 3 and encoder.max_pending == 3
    assert device.peak_bytes < 4 * (32 << 20) + ENCODE_SCRATCH["ans"][0]
    assert_same(restore_through(decoder(FakeDevice()), store, flat), state)


def test_chunks_cancelled_while_encoding_give_their_slots_back() -> None:
    """A failing save cancels the chunks it no longer wants while the worker is encoding them:
    their slots come back to the ring once the batch ends (nobody will write or release them)."""
    gate = threading.Event()

    class SlowDevice(FakeDevice):
        def record(self, operation: str, codec: Any, count: int) -> None:
            super().record(operation, codec, count)
            if operation == "encode":
                gate.wait(TIMEOUT)

    flat = flatten({"w": (np.random.default_rng(4).standard_normal(100_000) * 0.02).astype(np.float32)})
    sources = [DeviceSource(a.source) for a in flat.arrays]
    encoder = GpuEncoder(sources, codec="ans", byte_planes="auto", device_id=0, chunk_bytes=CHUNK,
                         max_staging_bytes=64 << 20, timeout=TIMEOUT, device=SlowDevice())
    plans = plan_chunks([(s.nbytes, s.itemsize, s.plane_width) for s in sources], chunk_bytes=CHUNK,
                        pack_below=CHUNK // 4)
    try:
        futures = [encoder.submit_encode(plan) for plan in plans[:3]]
        assert all(future.cancel() for future in futures)
        gate.set()
        encoder._worker.close()  # the batch has ended
        assert encoder.ring is not None and encoder.ring.free_slots() == encoder.ring.slots
    finally:
        gate.set()
        encoder.close()


def test_a_restore_first_waits_for_work_queued_on_the_callers_streams() -> None:
    """Before a restore's first read (and so before anything is written to a destination), the
    decoder waits once for the work the caller queued on the device's current streams."""
    state = weights(2)
    store, flat, _ = save_through(FakeDevice(), state, codec="ans")
    device = FakeDevice()
    got, _targets = restore_into(device, store, flat, lambda a: DeviceMemoryTarget(a.shape, a.dtype))
    assert_same(got, state)
    operations = [call[0] for call in device.calls]
    assert operations.count("wait_for_current_streams") == 1
    assert operations.index("wait_for_current_streams") < operations.index("decode")


def test_decoder_ring_bounds_outstanding_reads_and_returns_every_slot() -> None:
    state = {"big": (np.random.default_rng(3).standard_normal(300_000) * 0.02).astype(np.float32)}
    store, flat, _ = save_through(FakeDevice(), state, codec="zstd")
    device = FakeDevice()
    dec = decoder(device, staging=1400 * KIB)  # two slots beside Zstd's decode scratch
    records = open_file(MemoryReader(store, "ckpt")).index.chunks
    peak = 0
    original = dec.read_buffer

    def counting_read_buffer(nbytes: int) -> Any:
        nonlocal peak
        buffer = original(nbytes)
        assert dec.ring is not None
        peak = max(peak, dec.ring.slots - dec.ring.free_slots())
        return buffer

    dec.read_buffer = counting_read_buffer  # type: ignore[method-assign]
    got = restore_through(dec, store, flat)
    assert_same(got, state)
    assert dec.ring is not None and 2 <= dec.ring.slots < len(records)
    assert 1 <= peak <= dec.ring.slots
    assert dec.ring.free_slots() == dec.ring.slots


def test_encoder_batches_queued_chunks_up_to_batch_chunks() -> None:
    """Chunks queued while the worker is busy are compressed together, at most ``batch_chunks``
    per nvCOMP call."""
    device = FakeDevice()
    gate = threading.Event()
    started = device.use_in_thread

    def held_use_in_thread() -> None:  # the worker waits here until every chunk is queued
        started()
        assert gate.wait(TIMEOUT)

    device.use_in_thread = held_use_in_thread  # type: ignore[method-assign]
    data = (np.random.default_rng(4).standard_normal(7 * CHUNK // 4) * 0.02).astype(np.float32)
    source = DeviceSource(flatten({"x": data}).arrays[0].source)
    encoder = GpuEncoder([source], codec="ans", byte_planes="auto", device_id=0, chunk_bytes=CHUNK,
                         max_staging_bytes=64 << 20, batch_chunks=3, timeout=TIMEOUT, device=device)
    try:
        plans = plan_chunks([(source.nbytes, 4, 4)], chunk_bytes=CHUNK, pack_below=CHUNK // 4)
        futures = [encoder.submit_encode(plan) for plan in plans]
        gate.set()
        encoded = [f.result(timeout=TIMEOUT) for f in futures]
    finally:
        encoder.close()
    assert [call[4] for call in device.calls if call[0] == "encode"] == [3, 3, 1]
    assert all(call[2] == "<f4" for call in device.calls)  # typed ANS for float32
    for enc in encoded:
        assert enc.payload.nbytes % ALIGNMENT == 0 and not enc.payload[enc.stored:].any()  # zero padded
        assert enc.crc == checksum(enc.payload[:enc.stored])
        assert enc.release is not None
        enc.release()


def test_worker_makes_the_device_current_before_using_it() -> None:
    device = FakeDevice()
    save_through(device, weights(), codec="zstd")
    assert len(device.device_threads) == 1 and threading.get_ident() not in device.device_threads


# -- byte-plane decisions and fallbacks ---------------------------------------------------------

def encode_one(device: FakeDevice, array: np.ndarray, *, codec: str, byte_planes: str = "auto",
               delta: bool = False, source: Any = None) -> Any:
    """Encode one chunk through a new encoder, checking that it holds one slot until the payload
    is released and none after."""
    source = source or DeviceSource(flatten({"x": array}).arrays[0].source)
    encoder = GpuEncoder([source], codec=codec, byte_planes=byte_planes, device_id=0, chunk_bytes=CHUNK,
                         max_staging_bytes=64 << 20, timeout=TIMEOUT, device=device)
    try:
        plan = ChunkPlan(0, [Part(0, 0, min(source.nbytes, CHUNK))], plane_width=source.plane_width,
                         decision_group=0, delta=delta)
        encoded = encoder.submit_encode(plan).result(timeout=TIMEOUT)
        assert encoder.ring is not None and encoder.ring.free_slots() == encoder.ring.slots - 1
        encoded.release()
        assert encoder.ring.free_slots() == encoder.ring.slots
        return encoded
    finally:
        encoder.close()


def stage_names(chain: Chain) -> list[str]:
    return [stage["name"] for stage in chain.to_json()]


@pytest.mark.parametrize("byte_planes, planed", [("always", True), ("never", False)])
def test_byte_planes_follow_the_setting_for_lz_codecs(byte_planes: str, planed: bool) -> None:
    array = (np.random.default_rng(5).standard_normal(CHUNK // 4) * 0.02).astype(np.float32)
    encoded = encode_one(FakeDevice(), array, codec="zstd", byte_planes=byte_planes)
    assert ("byteplanes/1" in stage_names(encoded.chain)) is planed


def test_auto_byte_planes_trial_picks_the_smaller_form() -> None:
    """float32 weights: planes separate the repetitive exponent bytes, so the trial takes them."""
    array = (np.random.default_rng(6).standard_normal(CHUNK // 4) * 0.02).astype(np.float32)
    encoded = encode_one(FakeDevice(), array, codec="zstd", byte_planes="auto")
    assert stage_names(encoded.chain) == ["byteplanes/1", "zstd/1"]


def test_ans_codes_floats_typed_and_xor_deltas_as_byte_planes() -> None:
    array = (np.random.default_rng(7).standard_normal(CHUNK // 2) * 0.02).astype(np.float16)
    typed = encode_one(FakeDevice(), array, codec="ans")
    assert typed.chain.to_json() == [{"name": "nvcomp.ans/1", "data_type": "<f2"}]
    delta = encode_one(FakeDevice(), array, codec="ans", delta=True)
    assert delta.chain.to_json() == [{"name": "byteplanes/1", "width": 2}, {"name": "nvcomp.ans/1"}]


def test_incompressible_chunk_is_stored_as_its_raw_bytes() -> None:
    array = np.random.default_rng(8).integers(0, 256, CHUNK, dtype=np.uint8)
    encoded = encode_one(FakeDevice(), array, codec="ans")
    assert encoded.chain.to_json() == [{"name": "none/1"}]
    assert encoded.payload[:encoded.stored].tobytes() == array.tobytes()


def rounded_source() -> Any:
    from gdsckpt.state import NumpySource
    from gdsckpt.state.lossy import RoundedSource, plan_rounding

    array = (np.random.default_rng(9).standard_normal(CHUNK // 4) * 0.02).astype(np.float32)
    rounding = plan_rounding(array, "grid", 1e-2)
    assert rounding is not None
    source = RoundedSource(NumpySource(array, "float32"), rounding)
    assert isinstance(source, RoundedArraySource)
    return source


def test_rounded_arrays_go_to_bitcomp_lossy_when_the_check_passes() -> None:
    device = FakeDevice()
    encoded = encode_one(device, np.zeros(0), codec="ans", source=rounded_source())
    (stage,) = encoded.chain.to_json()
    assert stage["name"] == "nvcomp.bitcomp-lossy/1" and stage["data_type"] == "<f4" and stage["delta"] > 0
    assert [c[0] for c in device.calls if c[1] == "bitcomp" and c[3] is not None] == ["encode", "decode"]


def test_rounded_arrays_fall_back_to_the_codec_when_bitcomp_decodes_other_values() -> None:
    device = FakeDevice()
    device.garble_lossy = True
    encoded = encode_one(device, np.zeros(0), codec="ans", source=rounded_source())
    assert stage_names(encoded.chain)[-1] == "nvcomp.ans/1"  # encode_one: the lossy try's slot came back


def test_portable_codecs_never_write_bitcomp_lossy() -> None:
    device = FakeDevice()
    encoded = encode_one(device, np.zeros(0), codec="zstd", source=rounded_source())
    assert stage_names(encoded.chain)[-1] == "zstd/1"
    assert not any(call[1] == "bitcomp" for call in device.calls)


def test_unknown_gpu_codec_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="has no GPU implementation.*ans"):
        GpuEncoder([], codec="brotli", byte_planes="auto", device_id=0, chunk_bytes=CHUNK,
                   max_staging_bytes=1 << 20, device=FakeDevice())


# -- errors -------------------------------------------------------------------------------------

def test_device_error_while_encoding_surfaces_as_itself_and_returns_the_slots() -> None:
    device = FakeDevice()
    array = (np.random.default_rng(10).standard_normal(CHUNK // 4) * 0.02).astype(np.float32)
    source = DeviceSource(flatten({"x": array}).arrays[0].source)
    encoder = GpuEncoder([source], codec="ans", byte_planes="auto", device_id=0, chunk_bytes=CHUNK,
                         max_staging_bytes=64 << 20, timeout=TIMEOUT, device=device)
    try:
        device.fail["encode"] = RuntimeError("CUDA error: out of memory")
        plan = ChunkPlan(0, [Part(0, 0, CHUNK)], plane_width=4, decision_group=0)
        with pytest.raises(RuntimeError, match="out of memory"):
            encoder.submit_encode(plan).result(timeout=TIMEOUT)
        assert encoder.ring is not None and encoder.ring.free_slots() == encoder.ring.slots
        again = encoder.submit_encode(plan).result(timeout=TIMEOUT)  # the encoder still works
        assert again.chain.to_json()[-1]["name"] == "nvcomp.ans/1"
    finally:
        encoder.close()


def saved_chunks(codec: str = "ans") -> tuple[MemoryStore, Any, Index]:
    store, flat, _ = save_through(FakeDevice(), weights(), codec=codec)
    return store, flat, open_file(MemoryReader(store, "ckpt")).index


def decode_all(dec: GpuDecoder, store: MemoryStore, index: Index, damage: Any = None) -> list[Future[None]]:
    reader = MemoryReader(store, "ckpt")
    dec.reserve_reads(index.chunks, sorted({index.chains[r.chain][-1]["name"] for r in index.chunks}))
    futures = []
    for record in index.chunks:
        buffer = dec.read_buffer(-(-record.stored // ALIGNMENT) * ALIGNMENT)
        reader.submit_read(record.offset, buffer).result(timeout=TIMEOUT)
        if damage is not None:
            record = damage(record, buffer)
        futures.append(dec.submit_decode(record, index.chains[record.chain], buffer, lambda raw: None))
    for future in futures:
        future.exception(timeout=TIMEOUT)
    return futures


def test_checksum_mismatch_is_corruption() -> None:
    store, _flat, index = saved_chunks()
    dec = decoder(FakeDevice())
    try:
        def flip(record: ChunkRecord, buffer: np.ndarray) -> ChunkRecord:
            buffer[0] ^= 1
            return record
        futures = decode_all(dec, store, index, flip)
    finally:
        dec.close()
    for future in futures:
        with pytest.raises(CorruptCheckpointError, match="checksum"):
            future.result()
    assert dec.ring is not None and dec.ring.free_slots() == dec.ring.slots


def test_one_damaged_chunk_fails_alone_and_the_batch_delivers_the_rest_bit_exact() -> None:
    """ANS and stored chunks go on the stream as one batch and are judged after it: the chunk
    whose bytes were flipped fails with a checksum mismatch, every other chunk of the same batch
    is delivered intact, and the ANS chunks took one decode call."""
    store, _flat, index = saved_chunks()
    ans = [i for i, r in enumerate(index.chunks) if index.chains[r.chain][-1]["name"] == "nvcomp.ans/1"]
    assert len(ans) >= 2 and len(index.chunks) <= 64
    device = FakeDevice()
    dec = decoder(device)
    reader = MemoryReader(store, "ckpt")
    dec.reserve_reads(index.chunks, ["nvcomp.ans/1"])
    delivered: dict[int, bytes] = {}
    try:
        jobs = []
        for number, record in enumerate(index.chunks):
            buffer = dec.read_buffer(-(-record.stored // ALIGNMENT) * ALIGNMENT)
            reader.submit_read(record.offset, buffer).result(timeout=TIMEOUT)
            if number == ans[0]:
                buffer[3] ^= 0x40
            jobs.append((record, buffer, number))
        futures = [Future() for _ in jobs]
        batch = [DecodeJob(record, index.chains[record.chain], buffer,
                           lambda raw, n=number: delivered.__setitem__(n, raw.tobytes()), future)
                 for (record, buffer, number), future in zip(jobs, futures)]
        dec._decode_batch(batch)  # the worker's call, made here so that the batch is exactly these chunks
    finally:
        dec.close()
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        futures[ans[0]].result(timeout=TIMEOUT)
    intact = saved_raw_chunks(store, index)
    for number, future in enumerate(futures):
        if number != ans[0]:
            future.result(timeout=TIMEOUT)
            assert delivered[number] == intact[number], number
    assert [c for c in device.calls if c[0] == "decode"] == [("decode", "ans", None, None, len(ans))]


def saved_raw_chunks(store: MemoryStore, index: Index) -> dict[int, bytes]:
    """Every chunk's raw bytes, decoded through an undamaged batch of the fake."""
    out: dict[int, bytes] = {}
    dec = decoder(FakeDevice())
    reader = MemoryReader(store, "ckpt")
    dec.reserve_reads(index.chunks, ["nvcomp.ans/1"])
    try:
        futures = []
        for number, record in enumerate(index.chunks):
            buffer = dec.read_buffer(-(-record.stored // ALIGNMENT) * ALIGNMENT)
            reader.submit_read(record.offset, buffer).result(timeout=TIMEOUT)
            futures.append(dec.submit_decode(record, index.chains[record.chain], buffer,
                                             lambda raw, n=number: out.__setitem__(n, raw.tobytes())))
        for future in futures:
            future.result(timeout=TIMEOUT)
    finally:
        dec.close()
    return out


def test_undecodable_stream_with_a_matching_checksum_is_corruption() -> None:
    store, _flat, index = saved_chunks()
    dec = decoder(FakeDevice())
    compressed = {i for i, r in enumerate(index.chunks) if index.chains[r.chain][-1]["name"] == "nvcomp.ans/1"}
    assert compressed
    try:
        def garble(record: ChunkRecord, buffer: np.ndarray) -> ChunkRecord:
            if index.chains[record.chain][-1]["name"] != "nvcomp.ans/1":
                return record
            buffer[:len(FAKE_MARKER)] = 0  # no longer a stream; the CRC is made to match
            return ChunkRecord(record.offset, record.stored, record.raw, checksum(buffer[:record.stored]),
                               record.chain)
        futures = decode_all(dec, store, index, garble)
    finally:
        dec.close()
    for i, future in enumerate(futures):
        if i in compressed:
            with pytest.raises(CorruptCheckpointError, match="does not decode"):
                future.result()
        else:
            future.result()


def test_device_error_while_decoding_surfaces_as_itself() -> None:
    """An error that does not prove damage (out of memory, a CUDA fault) reaches the chunks as
    itself, so that a restore stops instead of skipping an intact checkpoint."""
    store, _flat, index = saved_chunks()
    device = FakeDevice()
    device.fail["decode"] = RuntimeError("CUDA error: an illegal memory access was encountered")
    dec = decoder(device)
    try:
        futures = decode_all(dec, store, index)
    finally:
        dec.close()
    errors = [f.exception() for f in futures]
    assert any(isinstance(e, RuntimeError) and "illegal memory access" in str(e) for e in errors)
    assert not any(isinstance(e, CorruptCheckpointError) for e in errors)
    assert dec.ring is not None and dec.ring.free_slots() == dec.ring.slots


def test_invalid_codec_stage_is_corruption() -> None:
    store, _flat, index = saved_chunks()
    index.chains = [[*chain[:-1], {**chain[-1], "data_type": ["<f4"]}] if chain[-1]["name"] == "nvcomp.ans/1"
                    else chain for chain in index.chains]
    dec = decoder(FakeDevice())
    try:
        futures = decode_all(dec, store, index)
    finally:
        dec.close()
    assert any(isinstance(f.exception(), CorruptCheckpointError) for f in futures)


def test_decoder_without_a_reserved_ring_allocates_per_chunk() -> None:
    store, _flat, index = saved_chunks("zstd")
    dec = decoder(FakeDevice())
    reader = MemoryReader(store, "ckpt")
    try:
        record = index.chunks[0]
        buffer = dec.read_buffer(-(-record.stored // ALIGNMENT) * ALIGNMENT)
        reader.submit_read(record.offset, buffer).result(timeout=TIMEOUT)
        got: list[np.ndarray] = []
        dec.submit_decode(record, index.chains[record.chain], buffer, lambda raw: got.append(np.array(raw))) \
            .result(timeout=TIMEOUT)
    finally:
        dec.close()
    assert dec.ring is None and got[0].nbytes == record.raw


# -- autotune -----------------------------------------------------------------------------------

def test_autotune_samples_ratios_through_the_device_backend() -> None:
    flat = flatten(weights())
    sources = [DeviceSource(a.source) for a in flat.arrays]
    ratios = sample_ratios_on(FakeDevice(), sources, ["ans", "zstd"])
    assert set(ratios) == {"ans", "zstd"} and all(r > 1.0 for r in ratios.values())


# -- restore staging sized from free device memory, host destinations through a bounce ---------

def test_restore_staging_budget_rule() -> None:
    from gdsckpt.pipeline.gpu.staging import RESTORE_STAGING_CAP, restore_staging_budget

    gib = 1 << 30
    assert restore_staging_budget(16 * gib, gib) == 4 * gib  # a quarter of what is free
    assert restore_staging_budget(2 * gib, gib) == gib  # never below the save's budget
    assert restore_staging_budget(100 * gib, gib) == RESTORE_STAGING_CAP  # at most the cap
    assert restore_staging_budget(100 * gib, 12 * gib) == 12 * gib  # unless the floor is higher
    assert restore_staging_budget(100 * gib, gib, explicit=512 << 20) == 512 << 20  # configured: as given


def test_decoder_sizes_its_ring_from_free_memory_but_never_beyond_the_chunks() -> None:
    state = {"big": (np.random.default_rng(4).standard_normal(300_000) * 0.02).astype(np.float32)}
    store, flat, _ = save_through(FakeDevice(), state, codec="zstd")
    records = open_file(MemoryReader(store, "ckpt")).index.chunks
    device = FakeDevice()
    device.free = 4 * 1600 * KIB  # a quarter of it: 1600 KiB (a few slots beside Zstd's scratch), above the floor
    dec = GpuDecoder(device_id=0, max_staging_bytes=200 * KIB, timeout=TIMEOUT, device=device)
    assert dec.max_staging_bytes == 1600 * KIB
    assert_same(restore_through(dec, store, flat), state)
    assert dec.ring is not None and dec.ring.nbytes <= 1600 * KIB and 2 <= dec.ring.slots < len(records)
    roomy = FakeDevice()
    roomy.free = 1 << 40
    dec = GpuDecoder(device_id=0, max_staging_bytes=200 * KIB, timeout=TIMEOUT, device=roomy)
    assert_same(restore_through(dec, store, flat), state)
    assert dec.ring is not None and dec.ring.slots == len(records)  # one slot per chunk, no more


def test_host_destinations_go_through_a_bounded_bounce_in_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    from gdsckpt.pipeline.gpu import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "HOST_BOUNCE_BYTES", 3 * CHUNK)
    rng = np.random.default_rng(5)
    state = {f"w{i}": (rng.standard_normal(CHUNK // 2) * 0.02).astype(np.float32) for i in range(6)}
    store, flat, _ = save_through(FakeDevice(), state, codec="ans")
    device = FakeDevice()
    downloads = []
    original = device.download

    def counted(out: np.ndarray, array: np.ndarray) -> None:
        downloads.append(out.nbytes)
        original(out, array)

    device.download = counted  # type: ignore[method-assign]
    assert_same(restore_through(decoder(device), store, flat), state)
    assert sum(downloads) == sum(a.nbytes for a in state.values())  # every byte through the bounce
    assert device.allocated["pinned"] == 3 * CHUNK  # one bounce buffer, of the configured size


def test_a_failed_copy_to_the_host_fails_the_restore() -> None:
    state = {"w": (np.random.default_rng(6).standard_normal(CHUNK // 2) * 0.02).astype(np.float32)}
    store, flat, _ = save_through(FakeDevice(), state, codec="ans")
    device = FakeDevice()
    device.fail["download"] = RuntimeError("copy failed")
    with pytest.raises(RuntimeError, match="copy failed"):
        restore_through(decoder(device), store, flat)


def test_packed_small_device_arrays_are_gathered_by_one_kernel_per_chunk() -> None:
    rng = np.random.default_rng(7)
    state = {f"t{i}": rng.standard_normal(int(rng.integers(1, 38))).astype(np.float32) for i in range(500)}
    state["strided"] = rng.standard_normal((40, 8)).astype(np.float32)[:, ::2]  # no span: copied as before
    device = FakeDevice()
    store, flat, _ = save_through(device, state, codec="ans")
    gathers = [call for call in device.calls if call[0] == "gather"]
    assert gathers and sum(call[4] for call in gathers) == 500  # every small contiguous array, none other
    assert len(gathers) <= len(open_file(MemoryReader(store, "ckpt")).index.chunks)
    assert_same(restore_through(decoder(FakeDevice()), store, flat), state)


# -- destinations made while the first chunks are read (DeferredTargets) ------------------------

class RecordingReader(MemoryReader):
    """A real in-memory reader that notes, in one list shared with the targets' maker, when each
    read is submitted."""

    def __init__(self, store: MemoryStore, name: str, events: list[str]):
        super().__init__(store, name)
        self.events = events

    def submit_read(self, offset: int, out: Any) -> Future[Any]:
        self.events.append("read")
        return super().submit_read(offset, out)


@pytest.mark.parametrize("codec", ["ans", "zstd", "none"])
def test_deferred_targets_are_made_one_by_one_as_their_chunks_come_and_restore_bit_exact(codec: str) -> None:
    state = weights(7)
    store, flat, _ = save_through(FakeDevice(), state, codec=codec)
    events: list[str] = []
    reader = RecordingReader(store, "ckpt", events)
    index = open_file(reader).index
    ids = list(range(len(flat.arrays)))

    def make(i: int) -> Any:
        events.append(f"target {i}")
        return DeviceMemoryTarget(flat.arrays[i].shape, flat.arrays[i].dtype)

    deferred = DeferredTargets(ids, make)
    dec = decoder(FakeDevice())
    submit_decode = dec.submit_decode

    def noted(*args: Any, **kwargs: Any) -> Any:
        events.append("decode")
        return submit_decode(*args, **kwargs)

    dec.submit_decode = noted  # type: ignore[method-assign]
    try:
        run_restore(reader, index, dec, deferred, max_inflight_bytes=1 << 30, timeout=TIMEOUT)
    finally:
        dec.close()
    made = [event for event in events if event.startswith("target")]
    assert sorted(made) == sorted(f"target {i}" for i in ids)  # each made once
    assert events[0] == "read"  # after a read was under way
    # each when the first chunk holding it comes: in the order of their first chunks, not all at once
    first_chunk = {i: min(s.chunk for s in index.tensors[i].segments) for i in ids if index.tensors[i].segments}
    order = [int(event.split()[1]) for event in made if int(event.split()[1]) in first_chunk]
    assert [first_chunk[i] for i in order] == sorted(first_chunk[i] for i in order)
    assert len(set(first_chunk.values())) > 2
    assert events.index("decode") < events.index(made[-1])  # not all made before the first decode
    targets = deferred.resolve()
    assert_same({a.key: targets[i].finish() for i, a in enumerate(flat.arrays)}, state)
    # the decoder still wrote its device destinations itself
    assert all(targets[i].delivered == 0 for i, a in enumerate(flat.arrays) if a.key != "steps")


def test_deferred_targets_of_a_restore_without_chunks_are_still_made() -> None:
    state = {"empty": np.zeros(0, dtype=np.float32)}
    store, _flat, _ = save_through(FakeDevice(), state, codec="ans")
    reader = MemoryReader(store, "ckpt")
    index = open_file(reader).index
    deferred = DeferredTargets([0], lambda _i: DeviceMemoryTarget((0,), np.float32))
    dec = decoder(FakeDevice())
    try:
        run_restore(reader, index, dec, deferred, max_inflight_bytes=1 << 30, timeout=TIMEOUT)
    finally:
        dec.close()
    assert deferred.resolve()[0].finish().shape == (0,)


def test_a_failure_making_deferred_targets_fails_the_restore_and_returns_the_slots() -> None:
    state = weights(8)
    store, flat, _ = save_through(FakeDevice(), state, codec="ans")
    reader = MemoryReader(store, "ckpt")
    index = open_file(reader).index

    def make(_i: int) -> Any:
        raise MemoryError("no room for the destinations")

    dec = decoder(FakeDevice(), staging=4 * CHUNK * 2)
    try:
        with pytest.raises(MemoryError, match="no room"):
            run_restore(reader, index, dec, DeferredTargets(list(range(len(flat.arrays))), make),
                        max_inflight_bytes=1 << 30, timeout=TIMEOUT)
        assert dec.ring is not None
    finally:
        dec.close()


def test_deferred_targets_must_match_their_ids_and_need_a_device_decoder() -> None:
    wrong = DeferredTargets([0, 1], lambda _i: NumpyTarget((1,), "float32"))
    with pytest.raises(ValueError, match="not announced"):
        wrong.take([2])
    state = weights(9)
    store, _flat, _ = save_through(FakeDevice(), state, codec="none", on_device=False)
    reader = MemoryReader(store, "ckpt")
    index = open_file(reader).index
    engine = HostEngine([], codec="none", byte_planes="never", threads=1)
    try:
        with pytest.raises(ValueError, match="CPU engine needs its targets"):
            run_restore(reader, index, engine, DeferredTargets([0], NumpyTarget), max_inflight_bytes=1 << 30)
    finally:
        engine.close()


def test_the_decoder_budget_leaves_out_the_bytes_reserved_for_destinations() -> None:
    device = FakeDevice()
    device.free = 8 * 400 * KIB
    reserved = GpuDecoder(device_id=0, max_staging_bytes=100 * KIB, timeout=TIMEOUT, device=device,
                          reserved_bytes=4 * 400 * KIB)
    plain = GpuDecoder(device_id=0, max_staging_bytes=100 * KIB, timeout=TIMEOUT, device=device)
    try:
        assert plain.max_staging_bytes == 800 * KIB  # a quarter of what is free
        assert reserved.max_staging_bytes == 400 * KIB  # a quarter of what is free less the reserve
    finally:
        reserved.close()
        plain.close()


class _HostBase:
    """A delta's base bytes (``state.delta.BaseBytes``'s interface), held in host memory here."""

    def __init__(self, array: np.ndarray):
        self.flat = array.reshape(-1).view(np.uint8)

    def device(self, start: int, stop: int) -> np.ndarray:
        return self.flat[start:stop]

    def host(self, start: int, stop: int) -> np.ndarray:
        return self.flat[start:stop]


@pytest.mark.parametrize(("dtype", "codec", "byte_planes"), [(np.uint8, "ans", "auto"), (np.float32, "lz4", "never")])
def test_a_gpu_delta_save_holds_no_xor_arrays_beyond_its_staging_budget(
        dtype: Any, codec: str, byte_planes: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta's XOR with its base is a new chunk-sized device array (``XorSource.device_bytes``).
    For a chunk that takes no byte planes the encoder read it in place, as a view of a tensor, and
    so held one per chunk of a batch (up to one per slot) beyond ``max_staging_bytes``: 1.21x the
    budget here. Now such bytes are copied into the chunk's slot, one at a time. A stand-in for
    ``cupy.bitwise_xor`` allocates its result from the fake device, as CuPy's pool would."""
    import sys
    import time
    import types

    from gdsckpt.state.delta import XorSource

    device = FakeDevice()

    def bitwise_xor(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        out = device.empty(a.nbytes)
        np.bitwise_xor(a, b, out=out)
        return out
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(bitwise_xor=bitwise_xor))
    use = device.use_in_thread  # the worker's first batch waits until the driver has queued every chunk
    monkeypatch.setattr(device, "use_in_thread", lambda: (time.sleep(0.3), use()))

    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, 24 << 20, dtype=np.uint8).view(dtype)
    new = base.copy()
    new.view(np.uint8)[::97] ^= 1
    flat = flatten({"w": new})
    sources = [XorSource(DeviceSource(array.source), _HostBase(base)) for array in flat.arrays]
    budget = 64 << 20
    encoder = GpuEncoder(sources, codec=codec, byte_planes=byte_planes, device_id=0, chunk_bytes=256 * KIB,
                         max_staging_bytes=budget, timeout=TIMEOUT, device=device, fit_chunk=True)
    plans = plan_chunks([(s.nbytes, s.itemsize, s.plane_width) for s in sources], chunk_bytes=encoder.chunk_bytes,
                        pack_below=encoder.chunk_bytes // 4, delta={0})
    store = MemoryStore()
    try:
        run_save(plans, encoder, MemoryWriter(store, "ckpt"), max_inflight_bytes=1 << 30,
                 index=index_template(flat, base={"path": "base.gdsckpt", "index_sha256": "0" * 64,
                                                  "file_length": 1 << 20, "depth": 1}), timeout=TIMEOUT)
    finally:
        encoder.close()
    assert encoder.max_pending > 8  # batches of many chunks: what held the arrays
    assert device.peak_bytes <= budget, (device.peak_bytes, budget)
    got = restore_through(decoder(FakeDevice()), store, flat)["w"]
    # without the base's bytes (an XorTarget's) the chunks decode to the XOR itself
    assert got.view(np.uint8).tobytes() == (new.view(np.uint8) ^ base.view(np.uint8)).tobytes()
