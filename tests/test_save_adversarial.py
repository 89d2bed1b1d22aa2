"""Adversarial checks of the GPU save path (``GpuEncoder`` fitting, batches, lossy path, the save
driver and ``save_flat``), run on the NumPy stand-in for the device (``fake_device``).

The first two found bugs (the fitting's probe held more than the budget; a hung device cost two
timeouts); the last two cover combinations nothing else exercises (device-resident lossy arrays
at the exact edge of the fitting rule; a failed write mid-save with the GPU encoder, previous
file kept)."""

from __future__ import annotations

import functools
import math
import re
import threading
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
from fake_device import FakeDevice
from test_fake_device import TIMEOUT, DeviceSource, save_through

from gdsckpt.api.saving import index_template
from gdsckpt.io.memory import MemoryReader, MemoryStore, MemoryWriter
from gdsckpt.pipeline.gpu import GpuEncoder
from gdsckpt.pipeline.gpu.staging import ENCODE_SCRATCH, STAGING_RING_SHARE
from gdsckpt.pipeline.load import open_file, run_restore
from gdsckpt.pipeline.plan import plan_chunks
from gdsckpt.pipeline.save import run_save
from gdsckpt.state import NumpyTarget, flatten
from gdsckpt.state.lossy import apply_policy

MIB = 1 << 20


def scratch_floor(codec: str) -> int:
    """The least budget that holds ``codec``'s fixed nvCOMP compression scratch alone."""
    return math.ceil(ENCODE_SCRATCH.get(codec, (0, 0))[0] / STAGING_RING_SHARE)


def restored_bytes(store: MemoryStore, flat: Any) -> dict[str, bytes]:
    """Every array's bytes as the fake GPU decoder restores them (uint8 targets: any dtype)."""
    from test_fake_device import decoder

    reader = MemoryReader(store, "ckpt")
    index = open_file(reader).index
    targets = {i: NumpyTarget((a.source.nbytes,), "uint8") for i, a in enumerate(flat.arrays)}
    dec = decoder(FakeDevice())
    try:
        run_restore(reader, index, dec, targets, max_inflight_bytes=1 << 30, timeout=TIMEOUT)
    finally:
        dec.close()
    return {a.key: targets[i].finish().tobytes() for i, a in enumerate(flat.arrays)}


# -- bugs found ----------------------------------------------------------------------------------

@pytest.mark.parametrize("codec", ["lz4", "ans", "deflate"])
def test_fitting_never_holds_more_device_memory_than_the_budget(codec: str) -> None:
    """``GpuEncoder._fit`` once allocated its bound probe at the chunk size asked for before
    halving: with ``gpu_chunk_bytes`` (16 MiB by default) above ``max_staging_bytes`` the save
    briefly held the whole asked chunk. It now probes only a size that may fit."""
    rng = np.random.default_rng(0)
    state = {"w": (rng.standard_normal(300_000) * 0.02).astype(np.float32)}
    staging = scratch_floor(codec) + 4 * MIB
    device = FakeDevice()
    _store, _flat, encoder = save_through(device, state, codec=codec, staging=staging, chunk_bytes=16 * MIB,
                                          fit_chunk=True)
    assert encoder.chunk_bytes < 16 * MIB  # it did fit the chunks ...
    assert device.peak_bytes <= staging, (device.peak_bytes, staging)  # ... but the probe did not


def test_a_save_whose_device_hangs_fails_after_one_timeout() -> None:
    """Fault injection: an encode that never returns fails the save with ``TimeoutError`` naming
    the chunk after the driver's one wait; closing the encoder then does not wait another timeout
    joining its stuck worker (``Encoder.stalled``), and that error is the one raised."""
    import gdsckpt.codecs.nvcomp as nvcomp
    import gdsckpt.pipeline.gpu as gpu_package
    from gdsckpt.api.saving import save_flat
    from gdsckpt.config import Config
    from gdsckpt.pipeline.gpu.worker import BatchWorker

    gate = threading.Event()

    class HungDevice(FakeDevice):
        def record(self, operation: str, codec: Any, count: int) -> None:
            super().record(operation, codec, count)
            if operation == "encode":
                gate.wait(30)  # the device never finishes (until the test ends)

    closes: list[bool] = []
    close = BatchWorker.close

    def recorded_close(self: BatchWorker, wait: bool = True) -> bool:
        closes.append(wait)
        return close(self, wait)

    mp = pytest.MonkeyPatch()
    mp.setattr(nvcomp, "gpu_available", lambda: True)
    mp.setattr(gpu_package, "GpuEncoder", functools.partial(GpuEncoder, device=HungDevice()))
    mp.setattr(BatchWorker, "close", recorded_close)
    try:
        with pytest.raises(TimeoutError, match=r"chunk 0 \(of \d+ bytes\) was not encoded within 0.3 s"):
            save_flat(flatten({"w": np.ones(100_000, np.float32)}), MemoryWriter(MemoryStore(), "ckpt"),
                      codec="ans", config=Config(engine="gpu", timeout=0.3, max_staging_bytes=scratch_floor("ans") + 8 * MIB,
                                                 gpu_chunk_bytes=64 << 10))
    finally:
        gate.set()
        mp.undo()
    assert closes == [False], closes  # the stuck worker was not waited for a second time


# -- combinations nothing else covers -------------------------------------------------------------

class DeviceRounded(DeviceSource):
    """A device-resident array rounded by ``save(lossy=...)`` (a ``RoundedArraySource`` on the
    device): its chunks take Bitcomp's lossy path with the check decoded in the slot's input."""

    def __init__(self, source: Any):
        super().__init__(source)
        self.rounding, self.dtype = source.rounding, source.dtype


@pytest.mark.parametrize("garble", [False, True])
def test_lossy_device_and_host_arrays_at_the_edge_of_the_budget_round_trip(garble: bool) -> None:
    """Device-resident and host rounded float32/float16 arrays,
    many tiny packed arrays, uint8 noise, in full batches, at exactly the least budget the
    fitting rule names (so any byte it does not count shows in the peak); Bitcomp's check
    passing or failing (fallback to ANS); every slot returned, restored bit-exact."""
    rng = np.random.default_rng(7)
    state: dict[str, Any] = {"a": (rng.standard_normal(200_000) * 0.02).astype(np.float32),
                             "h": (rng.standard_normal(60_001) * 0.02).astype(np.float16),
                             "n": rng.integers(0, 256, 100_000, dtype=np.uint8),
                             "empty": np.zeros(0, np.float32)}
    for i in range(150):
        state[f"t{i}"] = rng.standard_normal(int(rng.integers(1, 300))).astype(np.float32)

    def sources() -> tuple[Any, list[Any]]:
        flat = flatten(state)
        apply_policy(flat, {"a": 1e-2, "h": 1e-2})
        return flat, [DeviceRounded(a.source) if a.key == "a" else a.source if a.key == "h"
                      else DeviceSource(a.source) for a in flat.arrays]

    flat, srcs = sources()
    with pytest.raises(ValueError, match="needs at least") as refused:
        GpuEncoder(srcs, codec="ans", byte_planes="auto", device_id=0, chunk_bytes=64 << 10,
                   max_staging_bytes=4096, device=FakeDevice(), fit_chunk=True)
    budget = int(re.search(r"at least (\d+)", str(refused.value)).group(1))  # type: ignore[union-attr]
    device = FakeDevice()
    device.garble_lossy = garble
    encoder = GpuEncoder(srcs, codec="ans", byte_planes="auto", device_id=0, chunk_bytes=64 << 10,
                         max_staging_bytes=budget, batch_chunks=64, timeout=TIMEOUT, device=device, fit_chunk=True)
    plans = plan_chunks([(s.nbytes, s.itemsize, s.plane_width) for s in srcs], chunk_bytes=encoder.chunk_bytes,
                        pack_below=encoder.chunk_bytes // 4)
    store = MemoryStore()
    try:
        run_save(plans, encoder, MemoryWriter(store, "ckpt"), max_inflight_bytes=1 << 30,
                 index=index_template(flat), timeout=TIMEOUT)
        assert encoder.ring is not None and encoder.ring.free_slots() == encoder.ring.slots == 2
    finally:
        encoder.close()
    assert device.peak_bytes <= budget
    names = {chain[-1]["name"] for chain in open_file(MemoryReader(store, "ckpt")).index.chains}
    assert ("nvcomp.bitcomp-lossy/1" in names) is not garble
    got = restored_bytes(store, flat)
    for source, array in zip(srcs, flat.arrays):
        assert got[array.key] == source.host_bytes(0, source.nbytes).tobytes(), array.key


def test_a_failed_write_mid_save_keeps_the_previous_file() -> None:
    """The fourth chunk's write fails while later chunks are queued on the GPU encoder's worker
    (fewer slots than chunks): the save raises that error, the store still holds the previous
    file, and the closed encoder takes no more work."""

    class FailingWriter(MemoryWriter):
        writes = 0

        def submit_write(self, offset: int, data: Any) -> Future[None]:
            FailingWriter.writes += 1
            if FailingWriter.writes == 5:  # the header, then the fourth chunk
                failed: Future[None] = Future()
                failed.set_exception(OSError("No space left on device"))
                return failed
            return super().submit_write(offset, data)

    rng = np.random.default_rng(3)
    state = {"w": (rng.standard_normal(400_000) * 0.02).astype(np.float32),
             **{f"s{i}": rng.standard_normal(int(rng.integers(1, 3000))).astype(np.float32) for i in range(100)}}
    flat = flatten(state)
    srcs = [DeviceSource(a.source) for a in flat.arrays]
    encoder = GpuEncoder(srcs, codec="zstd", byte_planes="auto", device_id=0, chunk_bytes=64 << 10,
                         max_staging_bytes=scratch_floor("zstd") + 8 * MIB, batch_chunks=3, timeout=TIMEOUT, device=FakeDevice(),
                         fit_chunk=True)
    plans = plan_chunks([(s.nbytes, s.itemsize, s.plane_width) for s in srcs], chunk_bytes=encoder.chunk_bytes,
                        pack_below=encoder.chunk_bytes // 4)
    assert encoder.ring is not None and encoder.ring.slots < len(plans)
    store = MemoryStore()
    store.put("ckpt", b"previous checkpoint")
    try:
        with pytest.raises(OSError, match="No space left"):
            run_save(plans, encoder, FailingWriter(store, "ckpt"), max_inflight_bytes=1 << 30,
                     index=index_template(flat), timeout=TIMEOUT)
    finally:
        encoder.close()
    assert store.get("ckpt") == b"previous checkpoint"
    with pytest.raises(RuntimeError, match="closed"):
        encoder.submit_encode(plans[0])


@pytest.mark.parametrize(("budget", "chosen"), [(1 << 30, "lz4"), (3 << 30, "zstd")])
def test_a_portable_gpu_engine_save_takes_a_codec_its_budget_holds(tmp_path: Any, budget: int, chosen: str) -> None:
    """``engine="gpu"`` with ``portable=True``: nvCOMP's Zstd needs about 1.1 GiB of scratch
    whatever the chunk size, so under the default budget the save takes nvCOMP's LZ4 (and says
    why) instead of being refused; a budget that holds Zstd's scratch gets Zstd. Either file
    loads bit-exact on the CPU, without the GPU."""
    import gdsckpt
    import gdsckpt.codecs.nvcomp as nvcomp
    import gdsckpt.pipeline.gpu as gpu_package
    from gdsckpt.api.saving import save_flat
    from gdsckpt.config import Config

    state = {"w": (np.random.default_rng(6).standard_normal(200_000) * 0.02).astype(np.float32)}
    device = FakeDevice()
    store = MemoryStore()
    mp = pytest.MonkeyPatch()
    mp.setattr(nvcomp, "gpu_available", lambda: True)
    mp.setattr(gpu_package, "GpuEncoder", functools.partial(GpuEncoder, device=device))
    try:
        report = save_flat(flatten(state), MemoryWriter(store, "ckpt"), codec="auto",
                           config=Config(engine="gpu", portable=True, max_staging_bytes=budget))
    finally:
        mp.undo()
    assert report.codec == chosen and report.auto["portable"] is True, report.auto
    assert ("portable_reason" in report.auto) == (chosen == "lz4"), report.auto
    assert device.peak_bytes <= budget
    loaded = gdsckpt.load(store.get("ckpt"))
    assert loaded["w"].tobytes() == state["w"].tobytes()
