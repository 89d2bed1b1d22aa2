"""GPU memory bounds and many tiny tensors, on a GPU host.

A state four times larger than ``max_staging_bytes`` saves and restores with the GPU memory
beyond the state within ``max_staging_bytes`` + 5% and host RSS growth within 1 GiB (issue 3's
targets; issue 8's resource bound); nvCOMP's Zstd, whose compression scratch (about 1.1 GiB,
whatever the chunk size) does not fit that budget, is refused there and checked under a budget
that holds it, its restore under the same restore budget as the others. Memory
is sampled device-wide (``cudaMemGetInfo``) every millisecond on a thread, so nvCOMP's own
allocations count too. 10,000 tiny CUDA tensors round
trip bit-exact (issue 3's per-call-overhead case); the seconds are printed, not asserted.

Run on a GPU host with:  python3 -m pytest -m gpu tests/gpu -s
"""

from __future__ import annotations

import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")
from gdsckpt.codecs.nvcomp import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs CUDA, CuPy and nvCOMP")]

import gdsckpt
from gdsckpt.demo import bit_equal

STAGING = 512 << 20
ZSTD_STAGING = 1536 << 20
"""A save budget that holds nvCOMP's Zstd scratch (about 1.2 GiB) beside a few 16 MiB slots."""


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """Peak device-wide GPU memory in use and host RSS over their values at entry."""

    def __enter__(self) -> _Peak:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        self._cupy = cupy
        self.free0 = cupy.cuda.runtime.memGetInfo()[0]
        self.rss0 = _rss()
        self.reserved0 = torch.cuda.memory_reserved()
        self.gpu = self.rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        self.gpu = max(self.gpu, self.free0 - self._cupy.cuda.runtime.memGetInfo()[0])
        self.rss = max(self.rss, _rss() - self.rss0)

    def _run(self) -> None:
        self._cupy.cuda.Device(0).use()
        while not self._stop.wait(0.001):
            self._sample()

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample()
        self.torch_growth = torch.cuda.memory_reserved() - self.reserved0
        """Bytes torch's caching allocator took meanwhile: the restored tensors themselves."""


def _big_state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    quarter = STAGING  # 4 x STAGING in all
    state = {}
    for i in range(2):
        state[f"bf16.{i}"] = (torch.randn(quarter // 2, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        state[f"fp32.{i}"] = torch.randn(quarter // 4, device="cuda", generator=g) * 0.02
    return state


def _warm_up(tmp_path) -> None:
    """CUDA modules and nvCOMP's kernels load on first use and stay: not part of a save's cost."""
    small = {"a": torch.randn(1 << 20, device="cuda").to(torch.bfloat16),
             "b": torch.randn(1 << 18, device="cuda")}
    gdsckpt.save(small, tmp_path / "warm.gdsckpt", codec="ans")
    gdsckpt.load(tmp_path / "warm.gdsckpt", device="cuda")


# nvCOMP's Deflate holds ~146 MiB per chunk in a batch, which leaves it two chunks per batch and
# far too slow at this size (gdsckpt.pipeline.gpu.ENCODE_SCRATCH): left out here.
@pytest.mark.parametrize("codec", ["ans", "lz4", "zstd"])
def test_gpu_memory_within_staging_budget_for_a_state_four_times_larger(tmp_path, codec):
    _warm_up(tmp_path)
    state = _big_state()
    logical = sum(t.nbytes for t in state.values())
    assert logical == 4 * STAGING
    # A restore's ring is sized from free memory unless configured: here it is held to the bound.
    config = gdsckpt.Config(max_staging_bytes=STAGING, restore_staging_bytes=STAGING, engine="gpu")
    path = tmp_path / "big.gdsckpt"
    bound = restore_bound = STAGING * 1.05  # the restore keeps restore_staging_bytes=STAGING throughout
    if codec == "zstd":
        # nvCOMP's Zstd holds ~1.1 GiB of scratch whatever the chunk size (ENCODE_SCRATCH): this
        # budget is refused before anything is written, and one that holds the scratch is kept
        with pytest.raises(ValueError, match="cannot hold two staging slots"):
            gdsckpt.save(state, path, codec=codec, config=config)
        assert not path.exists()
        config = config.replace(max_staging_bytes=ZSTD_STAGING)
        bound = ZSTD_STAGING * 1.05
    with _Peak() as save_peak:
        gdsckpt.save(state, path, codec=codec, config=config)
    with _Peak() as load_peak:
        loaded = gdsckpt.load(path, device="cuda", config=config)
    load_beyond = load_peak.gpu - load_peak.torch_growth
    # With the default, the ring takes what the rule allows (restore_staging_budget) and no more.
    from gdsckpt.pipeline.gpu.staging import restore_staging_budget

    free, _total = torch.cuda.mem_get_info()
    with _Peak() as default_peak:
        default_loaded = gdsckpt.load(path, device="cuda", config=config.replace(restore_staging_bytes=None))
    default_beyond = default_peak.gpu - default_peak.torch_growth
    assert all(bit_equal(state[k], default_loaded[k]) for k in state)
    del default_loaded
    assert default_beyond <= restore_staging_budget(free, config.max_staging_bytes) * 1.05
    print(f"\n{codec}: state {logical / 2**20:.0f} MiB, staging budget {config.max_staging_bytes / 2**20:.0f} MiB; GPU beyond "
          f"the state: save {save_peak.gpu / 2**20:.0f} MiB, load {load_beyond / 2**20:.0f} MiB "
          f"(restored tensors {load_peak.torch_growth / 2**20:.0f} MiB); host RSS growth: save "
          f"{save_peak.rss / 2**20:.0f} MiB, load {load_peak.rss / 2**20:.0f} MiB")
    assert all(bit_equal(state[k], loaded[k]) for k in state)
    assert save_peak.gpu <= bound, f"save used {save_peak.gpu / 2**20:.0f} MiB beyond the state"
    assert load_beyond <= restore_bound, f"load used {load_beyond / 2**20:.0f} MiB beyond the restored state"
    assert save_peak.rss <= 1 << 30 and load_peak.rss <= 1 << 30


def test_ten_thousand_tiny_cuda_tensors_round_trip(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(3)
    state = {f"layer{i // 10}.p{i % 10}": torch.randn(1 + i % 37, device="cuda", generator=g)
             for i in range(10_000)}
    path = tmp_path / "tiny.gdsckpt"
    _warm_up(tmp_path)
    torch.cuda.synchronize()
    started = time.perf_counter()
    report = gdsckpt.save(state, path, codec="ans")
    saved = time.perf_counter()
    loaded = gdsckpt.load(path, device="cuda")
    torch.cuda.synchronize()
    done = time.perf_counter()
    print(f"\n10,000 tiny tensors ({report.logical_bytes} bytes, {report.chunks} chunks): "
          f"save {saved - started:.3f} s, load {done - saved:.3f} s")
    assert report.engine == "gpu" and report.chunks < 10
    assert loaded.keys() == state.keys()
    assert all(bit_equal(state[k], loaded[k]) and loaded[k].is_cuda for k in state)


def test_cpu_written_zstd_file_of_64_mib_chunks_restores_into_cuda_within_its_budget(tmp_path):
    """A CPU-engine Zstd file's chunks may exceed nvCOMP's 16 MiB: the GPU decoder then budgets
    their scratch in proportion (``DECODE_SCRATCH``) and keeps the restore within
    ``restore_staging_bytes``, or refuses the budget before reading, naming the least that fits."""
    _warm_up(tmp_path)
    g = torch.Generator(device="cpu").manual_seed(5)
    state = {"bf16": (torch.randn(STAGING // 4, generator=g) * 0.02).to(torch.bfloat16),
             "fp32": torch.randn(STAGING // 8, generator=g) * 0.02}
    path = tmp_path / "cpu64.gdsckpt"
    report = gdsckpt.save(state, path, codec="zstd", config=gdsckpt.Config(engine="cpu", chunk_bytes=64 << 20))
    assert report.engine == "cpu" and report.chunks >= 4
    config = gdsckpt.Config(restore_staging_bytes=STAGING)
    try:
        with _Peak() as peak:
            loaded = gdsckpt.load(path, device="cuda", config=config)
    except ValueError as refused:  # a refusal must name a budget that fits, and that budget must hold
        print(f"\nrefused under {STAGING >> 20} MiB: {refused}")
        assert "restore_staging_bytes" in str(refused)
        config = gdsckpt.Config(restore_staging_bytes=4 * STAGING)
        with _Peak() as peak:
            loaded = gdsckpt.load(path, device="cuda", config=config)
    beyond = peak.gpu - peak.torch_growth
    print(f"\nCPU-engine Zstd, 64 MiB chunks, into CUDA: {beyond / 2**20:.0f} MiB beyond the restored "
          f"tensors under restore_staging_bytes={config.restore_staging_bytes >> 20} MiB")
    assert all(loaded[k].is_cuda and bit_equal(state[k].cuda(), loaded[k]) for k in state)
    assert beyond <= config.restore_staging_bytes * 1.05
