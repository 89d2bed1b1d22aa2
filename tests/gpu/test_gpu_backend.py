"""The real device backend (``codecs.device.CudaDevice``) against what the CPU suite assumes of
it: the device twins of the transforms give the CPU's bytes, CRC-32C and padding are right, the
GPU encoder and decoder run on it as they run on the NumPy stand-in (``tests/fake_device.py``),
and kvikio's process-wide settings are restored after use.

Run on a GPU host with:  python3 -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
from gdsckpt.codecs.nvcomp import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs CUDA, CuPy and nvCOMP")]


from gdsckpt.api.saving import index_template
from gdsckpt.codecs.cpu import planes_forward_reference, planes_inverse_reference
from gdsckpt.codecs.device import (
    CudaDevice,
    planes_forward_into,
    planes_inverse_into,
    same_values,
)
from gdsckpt.format import ALIGNMENT, checksum
from gdsckpt.io.memory import MemoryReader, MemoryStore, MemoryWriter
from gdsckpt.pipeline.gpu import GpuDecoder, GpuEncoder
from gdsckpt.pipeline.load import open_file, run_restore
from gdsckpt.pipeline.plan import plan_chunks
from gdsckpt.pipeline.save import run_save
from gdsckpt.state import CupySource, NumpyTarget, flatten

CHUNK = 1 << 20
TIMEOUT = 120.0


@pytest.mark.parametrize("width", [2, 4, 8])
def test_device_byte_planes_equal_the_cpu_definition(width: int) -> None:
    host = np.random.default_rng(width).integers(0, 256, 3 * width * 4099, dtype=np.uint8)
    device = CudaDevice(0)
    try:
        with device.on_stream():
            data = cupy.asarray(host)
            planed = planes_forward_into(data, device.empty(host.nbytes), width)
            back = planes_inverse_into(planed, device.empty(host.nbytes), width)
            assert device.to_host(planed).tobytes() == planes_forward_reference(host, width).tobytes()
            assert device.to_host(back).tobytes() == planes_inverse_reference(
                planes_forward_reference(host, width), width).tobytes() == host.tobytes()
    finally:
        device.close()


def test_backend_crc_zero_fill_and_flags() -> None:
    device = CudaDevice(0)
    try:
        with device.on_stream():
            buffers = [cupy.asarray(np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8))
                       for i, n in enumerate([1, 4095, 4096, 1 << 20])]
            assert device.crc32c(buffers) == [checksum(cupy.asnumpy(b)) for b in buffers]
            ring = cupy.full(3 * ALIGNMENT, 7, dtype=cupy.uint8)
            device.zero_fill([ring[10:ALIGNMENT], ring[ALIGNMENT + 1:2 * ALIGNMENT]])
            host = device.to_host(ring)
            assert not host[10:ALIGNMENT].any() and not host[ALIGNMENT + 1:2 * ALIGNMENT].any()
            assert (host[:10] == 7).all() and host[ALIGNMENT] == 7 and (host[2 * ALIGNMENT:] == 7).all()
            a = cupy.asarray(np.array([0.0, 1.5], dtype=np.float32)).view(cupy.uint8)
            b = cupy.asarray(np.array([-0.0, 1.5], dtype=np.float32)).view(cupy.uint8)
            c = cupy.asarray(np.array([0.0, 1.25], dtype=np.float32)).view(cupy.uint8)
            assert device.all_true([same_values(cupy, a, b, 4), False, same_values(cupy, a, c, 4), True]) == \
                [True, False, False, True]
            assert device.address(ring[5:]) == device.address(ring) + 5
    finally:
        device.close()


def test_backend_works_from_a_worker_thread_after_use_in_thread() -> None:
    device = CudaDevice(0)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            device.use_in_thread()
            with device.on_stream():
                device.crc32c([device.empty(4096)])
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(TIMEOUT)
    device.close()
    assert not errors, errors


def _save_restore(codec: str, state: dict[str, Any], staging: int) -> tuple[dict[str, Any], GpuEncoder, GpuDecoder]:
    flat = flatten(state)
    sources = [a.source for a in flat.arrays]
    assert all(isinstance(s, CupySource) for s in sources)
    plans = plan_chunks([(s.nbytes, s.itemsize, s.plane_width) for s in sources], chunk_bytes=CHUNK,
                        pack_below=CHUNK // 4)
    encoder = GpuEncoder(sources, codec=codec, byte_planes="auto", device_id=0, chunk_bytes=CHUNK,
                         max_staging_bytes=staging, timeout=TIMEOUT)
    store = MemoryStore()

    class HostPayloads(MemoryWriter):  # the in-memory store takes host bytes: copy device payloads
        def submit_write(self, offset: int, data: Any) -> Any:
            return super().submit_write(offset, data if isinstance(data, (bytes, np.ndarray)) else data.get())

    try:
        run_save(plans, encoder, HostPayloads(store, "ckpt"), max_inflight_bytes=1 << 30, index=index_template(flat),
                 timeout=TIMEOUT)
    finally:
        encoder.close()
    reader = MemoryReader(store, "ckpt")
    index = open_file(reader).index
    decoder = GpuDecoder(device_id=0, max_staging_bytes=staging, timeout=TIMEOUT)

    class DeviceReads(MemoryReader):  # fills the decoder's device buffers from the host store
        def submit_read(self, offset: int, out: Any) -> Any:
            if isinstance(out, np.ndarray):
                return super().submit_read(offset, out)
            host = np.empty(out.nbytes, dtype=np.uint8)
            future = super().submit_read(offset, host)
            future.result()
            out.set(host)
            cupy.cuda.runtime.deviceSynchronize()
            return future

    targets = {i: NumpyTarget(a.shape, a.dtype) for i, a in enumerate(flat.arrays)}

    for target in targets.values():
        target.write_device = lambda start, data, t=target: t.write_host(start, cupy.asnumpy(data))  # type: ignore[attr-defined]
    try:
        run_restore(DeviceReads(store, "ckpt"), index, decoder, targets, max_inflight_bytes=1 << 30, timeout=TIMEOUT)
    finally:
        decoder.close()
    return {a.key: targets[i].finish() for i, a in enumerate(flat.arrays)}, encoder, decoder


@pytest.mark.parametrize("codec", ["ans", "zstd", "lz4", "bitcomp", "none"])
def test_encoder_and_decoder_round_trip_on_the_gpu_with_a_small_ring(codec: str) -> None:
    """The scenario of ``tests/test_fake_device.py`` on the real backend: more chunks than slots,
    bit-exact back, every slot returned."""
    rng = np.random.default_rng(0)
    host = {"w": (rng.standard_normal(3 << 20) * 0.02).astype(np.float32),
            "h": (rng.standard_normal(1 << 20) * 0.02).astype(np.float16),
            "n": rng.integers(0, 256, 1 << 20, dtype=np.uint8)}
    state = {key: cupy.asarray(value) for key, value in host.items()}
    got, encoder, decoder = _save_restore(codec, state, staging=64 << 20)
    for key, value in host.items():
        assert got[key].tobytes() == value.tobytes(), key
    assert encoder.ring is not None and encoder.ring.free_slots() == encoder.ring.slots
    assert decoder.ring is not None and decoder.ring.free_slots() == decoder.ring.slots


def test_kvikio_settings_are_restored_after_our_files_close(tmp_path) -> None:
    kvikio_defaults = pytest.importorskip("kvikio.defaults")
    import gdsckpt

    before = kvikio_defaults.get("thread_pool_nthreads")
    wanted = before + 3
    config = gdsckpt.Config(kvikio_threads=wanted)
    gdsckpt.save({"x": cupy.arange(1 << 20, dtype=cupy.float32)}, tmp_path / "k.gdsckpt", config=config)
    assert kvikio_defaults.get("thread_pool_nthreads") == before
    back = gdsckpt.load(tmp_path / "k.gdsckpt", device="cuda", config=config)
    assert kvikio_defaults.get("thread_pool_nthreads") == before
    assert bool((cupy.asarray(back["x"]) == cupy.arange(1 << 20, dtype=cupy.float32)).all())


def test_a_kvikio_reader_reads_a_file_not_in_the_page_cache_in_cold_read_tasks(tmp_path) -> None:
    """In compat mode a file whose pages are not cached is read in ``COLD_READ_TASK_BYTES`` tasks,
    a cached one in kvikio's own, a configured ``task_size`` always wins; each reads the file's
    bytes, and kvikio's process-wide task size is left alone."""
    import os

    kvikio_defaults = pytest.importorskip("kvikio.defaults")
    from gdsckpt.io import kvikio as kvikio_io
    from gdsckpt.io.posix import in_page_cache

    size = 3 * kvikio_io.COLD_READ_TASK_BYTES + 4096
    data = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "cold.bin"
    path.write_bytes(data.tobytes())

    def evict() -> bool:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return in_page_cache(fd, size) is False
        finally:
            os.close(fd)

    def read_whole(**kwargs: Any) -> tuple[str, int | None]:
        task_before = kvikio_defaults.get("task_size")
        with kvikio_io.KvikioReader(path, threads=4, **kwargs) as reader:
            out = cupy.empty(size, dtype=cupy.uint8)
            reader.submit_read(0, out).result(60)
            assert out.get().tobytes() == data.tobytes()
            found = reader.name, reader.read_task_bytes
        assert kvikio_defaults.get("task_size") == task_before
        return found

    if not evict():
        pytest.skip("this filesystem keeps the file's pages cached (tmpfs) or cannot tell")
    mode, task = read_whole()
    if mode != "kvikio-compat":
        assert task is None  # GPUDirect Storage: no page cache, kvikio's task size
        return
    assert task == kvikio_io.COLD_READ_TASK_BYTES
    path.read_bytes()  # now in the page cache
    assert read_whole() == (mode, None)
    assert evict()
    assert read_whole(task_size=1 << 20) == (mode, None)


def test_kvikio_writer_writes_in_tasks_of_write_task_bytes_in_compat_mode(tmp_path: Path) -> None:
    """Unconfigured, device-buffer writes in compat mode run in ``WRITE_TASK_BYTES`` tasks (each
    call's own: kvikio's process-wide setting is left alone); a configured ``task_size`` is kvikio's
    to use. Either way the file holds the bytes, across several tasks and a ragged end."""
    import cupy
    from kvikio import defaults as kvikio_defaults

    from gdsckpt.io import kvikio as kvikio_io

    size = 3 * kvikio_io.WRITE_TASK_BYTES + 4096
    data = np.random.default_rng(8).integers(0, 256, size, dtype=np.uint8)
    for configured in (None, 1 << 20):
        path = tmp_path / f"w-{configured}.bin"
        task_before = kvikio_defaults.get("task_size")
        writer = kvikio_io.KvikioWriter(path, threads=4, task_size=configured)
        try:
            writer.submit_write(0, cupy.asarray(data)).result(60)
            expected = (kvikio_io.WRITE_TASK_BYTES if configured is None and writer.name == "kvikio-compat"
                        else None)
            assert writer.write_task_bytes == expected
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        assert kvikio_defaults.get("task_size") == task_before
        assert path.read_bytes() == data.tobytes()
