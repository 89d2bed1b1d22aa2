"""Running out of GPU memory while restoring stops the restore; it never passes over the intact
newest checkpoint (the GPU half of ``tests/reliability/test_resource_errors.py``).

A ``CheckpointManager`` directory holds steps 1 and 2 of a CUDA model, written by the GPU engine
with the default codec. The device is then filled (torch allocations, then raw ``cudaMalloc``
down to 512 bytes) either before the restore (the restore ring cannot be allocated) or right after
the engine reserved its ring (the CRC and nvCOMP allocations of the decode fail, unless the
restore holds all it needs already: it then restores step 2 bit-exact):
``restore_latest(model=...)`` raises an out-of-memory error, warns nothing and does not restore
step 1. With the memory freed, step 2 restores bit-exact. nvCOMP's own errors are classified by
``reports_undecodable``: its out-of-memory error on a valid stream is not damage.

Run on a GPU host with:  python3 -m pytest -m gpu tests/gpu/test_gpu_resource_errors.py
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from gdsckpt.codecs.nvcomp import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs CUDA, CuPy and nvCOMP")]

import gdsckpt
from gdsckpt import CheckpointManager, SkippedCheckpointWarning
from gdsckpt.codecs.nvcomp import reports_undecodable
from gdsckpt.pipeline.gpu import GpuDecoder

CONFIG = gdsckpt.Config(gpu_chunk_bytes=1 << 20, max_staging_bytes=64 << 20, fsync=True)


def _model() -> Any:
    return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)).cuda()


def _fill(model: Any, seed: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(torch.randn(tensor.shape, generator=g) * 0.02)


def _bits(model: Any) -> dict[str, bytes]:
    return {key: tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
            for key, tensor in model.state_dict().items()}


class DeviceHog:
    """Holds (almost) all free device memory: torch blocks down to 2 MiB, then raw ``cudaMalloc``
    blocks down to 512 bytes (which torch's allocator would round up)."""

    def __init__(self) -> None:
        import cupy

        self._cupy = cupy
        self.tensors: list[Any] = []
        self.pointers: list[int] = []

    def take(self) -> int:
        """Allocate; returns the bytes the device still reports free."""
        cupy = self._cupy
        torch.cuda.synchronize()
        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
        size = 1 << 36
        while size >= 2 << 20:
            try:
                self.tensors.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.cuda.OutOfMemoryError:
                size //= 2
        size = 2 << 20
        while size >= 512:
            try:
                self.pointers.append(cupy.cuda.runtime.malloc(size))
            except cupy.cuda.runtime.CUDARuntimeError:
                size //= 2
        return int(cupy.cuda.runtime.memGetInfo()[0])

    def release(self) -> None:
        for pointer in self.pointers:
            self._cupy.cuda.runtime.free(pointer)
        self.pointers.clear()
        self.tensors.clear()
        torch.cuda.empty_cache()


@pytest.fixture
def hog() -> Any:
    held = DeviceHog()
    yield held
    held.release()


def _is_out_of_memory(err: BaseException) -> bool:
    """CuPy's ``OutOfMemoryError`` is a ``MemoryError``, torch's a ``RuntimeError``; nvCOMP and the
    CUDA runtime raise ``RuntimeError`` / ``CUDARuntimeError`` naming cudaErrorMemoryAllocation."""
    return isinstance(err, (MemoryError, torch.cuda.OutOfMemoryError)) or "out of memory" in str(err).lower()


@pytest.fixture
def run(tmp_path: Path) -> tuple[CheckpointManager, dict[int, dict[str, bytes]]]:
    """Steps 1 and 2 written by the GPU engine (default codec); their bits by step."""
    manager = CheckpointManager(tmp_path / "run", keep_last=None, config=CONFIG)
    model, saved = _model(), {}
    for step in (1, 2):
        _fill(model, step)
        manager.save(step, {"model": model.state_dict()})
        saved[step] = _bits(model)
    codecs = gdsckpt.inspect(manager.path(2)).codecs
    assert any(name != "none/1" for name in codecs), codecs  # compressed on the GPU
    return manager, saved


@pytest.mark.parametrize("when", ["before the restore", "after the ring is reserved"])
def test_restore_latest_on_a_full_gpu_raises_out_of_memory(when: str, run: Any, hog: DeviceHog,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    manager, saved = run
    model = _model()
    _fill(model, 0)
    fresh = _bits(model)
    if when == "before the restore":
        free = hog.take()
    else:
        original = GpuDecoder.reserve_reads
        taken: list[int] = []

        def reserve_then_fill(self: GpuDecoder, *args: Any, **kwargs: Any) -> Any:
            slots = original(self, *args, **kwargs)
            taken.append(hog.take())
            return slots

        monkeypatch.setattr(GpuDecoder, "reserve_reads", reserve_then_fill)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result: Any = manager.restore_latest(model=model)
        except Exception as err:
            result = err
    monkeypatch.undo()
    if when != "before the restore":
        assert taken, "the restore never reserved its ring"
        free = taken[0]
    hog.release()
    skipped = [str(w.message) for w in caught if issubclass(w.category, SkippedCheckpointWarning)]
    assert not skipped, skipped
    if when != "before the restore" and not isinstance(result, BaseException):
        # Everything the decode needs beyond its ring may already be held when the device fills
        # up (CuPy's pool keeps freed blocks; the decode's few small buffers may come from them,
        # or fit in what the driver still reports free): the restore then completes, and must
        # have restored the newest step bit-exact.
        assert result[0] == 2 and _bits(model) == saved[2], f"restored {result!r} with {free} bytes free"
        print(f"\n{when}: {free} bytes free -> restored step 2 bit-exact (nothing left to allocate)")
        return
    assert isinstance(result, BaseException), f"restored {result!r} with {free} bytes of GPU memory free"
    assert _is_out_of_memory(result), repr(result)
    assert not isinstance(result, gdsckpt.CorruptCheckpointError)
    now = _bits(model)
    assert all(now[key] != saved[1][key] for key in now), "step 1 was restored"
    if when == "before the restore":
        assert now == fresh  # nothing was written
    print(f"\n{when}: {free} bytes free -> {type(result).__module__}.{type(result).__qualname__}: "
          f"{str(result)[:200]}")

    step, _extra = manager.restore_latest(model=model)  # memory back: the newest step, bit-exact
    assert step == 2 and _bits(model) == saved[2]


def test_nvcomp_out_of_memory_on_a_valid_stream_is_not_damage(hog: DeviceHog) -> None:
    """nvCOMP's Zstd needs scratch to decode (``DECODE_SCRATCH``): on a full device its decode of
    a valid stream fails, and that error is not read as an undecodable stream."""
    import cupy

    from gdsckpt.codecs.nvcomp import DeviceCodec

    stream = cupy.cuda.Stream(non_blocking=True)
    raw = cupy.asarray((np.random.default_rng(0).standard_normal(4 << 20).astype(np.float32) * 0.02).view(np.uint8))
    with stream:
        codec = DeviceCodec("zstd", stream=stream, device_id=0)
        capacity = codec.max_compressed_bytes(raw)
        buffer = cupy.zeros(capacity, dtype=cupy.uint8)
        size = codec.encode_into([raw], buffer, [0], capacity)[0]
        encoded = buffer[:size].copy()
        out = cupy.zeros(raw.nbytes, dtype=cupy.uint8)
        stream.synchronize()
        del buffer
        free = hog.take()
        try:
            codec.decode_into([encoded], out, [0], [raw.nbytes])
            stream.synchronize()
        except (RuntimeError, MemoryError) as err:
            failure: BaseException | None = err
        else:
            failure = None
    hog.release()
    codec.close()  # here, not when the collector finds it on some other thread
    if failure is None:
        pytest.skip(f"nvCOMP decoded with {free} bytes free: it allocated nothing here")
    print(f"\nnvCOMP Zstd decode with {free} bytes free: {type(failure).__qualname__}: {str(failure)[:300]}")
    assert not reports_undecodable(failure), str(failure)


def test_crc_valid_garbage_stream_is_damage_and_restore_falls_back(run: Any, h: Any) -> None:
    """A compressed chunk of the newest checkpoint replaced by 0xFF bytes and its CRC-32C in the
    index recomputed (a crafted or miswritten file): the GPU load raises
    ``CorruptCheckpointError``, and ``restore_latest`` falls back to step 1 with a warning."""
    from gdsckpt.format import checksum

    manager, saved = run
    path = manager.path(2)
    index = h.read_index(path)
    number = next(i for i, record in enumerate(index.chunks)
                  if index.chains[record.chain][-1]["name"] != "none/1")
    record = index.chunks[number]
    data = bytearray(path.read_bytes())
    data[record.offset:record.offset + record.stored] = b"\xff" * record.stored
    path.write_bytes(bytes(data))

    def edit(doc: dict[str, Any]) -> None:
        doc["chunks"][number][3] = checksum(np.full(record.stored, 0xFF, dtype=np.uint8))

    h.rewrite_index(path, edit)
    model = _model()
    with pytest.raises(gdsckpt.CorruptCheckpointError):
        gdsckpt.load_into({"model": model}, path, config=CONFIG)
    with pytest.warns(SkippedCheckpointWarning, match="does not decode|decoded to"):
        step, _extra = manager.restore_latest(model=model)
    assert step == 1 and _bits(model) == saved[1]
