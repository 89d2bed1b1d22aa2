"""``save_async`` with ``Config(async_worker="process")`` on CUDA tensors: the worker process reads
the snapshot through CUDA IPC (device snapshot) or page-locked shared host memory (pinned
snapshot), runs the GPU engine (or, with ``async_engine="cpu"``, the CPU engine, reading the
device snapshot through host copies), and the file is bit-exact with the state at call time.

Run on a GPU host with:  python3 -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from gdsckpt.codecs.nvcomp import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs CUDA, CuPy and nvCOMP")]

import gdsckpt
from gdsckpt.background.async_save import AsyncSaver
from gdsckpt.demo import bit_equal


def _state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(9)
    return {"bf16": (torch.randn(4 << 20, device="cuda", generator=g) * 0.02).to(torch.bfloat16),
            "fp32": torch.randn(3 << 20, device="cuda", generator=g),
            "small": [torch.randn(100, device="cuda", generator=g) for _ in range(50)],
            "host": torch.arange(1000), "step": 7}


@pytest.mark.parametrize("async_engine", ["auto", "cpu"])
@pytest.mark.parametrize("snapshot_gpu_bytes", [1 << 30, 0], ids=["device-snapshot", "pinned-snapshot"])
def test_process_worker_saves_cuda_tensors_bit_exact(tmp_path, snapshot_gpu_bytes, async_engine):
    config = gdsckpt.Config(async_worker="process", snapshot_gpu_bytes=snapshot_gpu_bytes, timeout=120,
                            async_engine=async_engine)
    codec, engine = ("ans", "gpu") if async_engine == "auto" else ("auto", "cpu")
    saver = AsyncSaver()
    try:
        state = _state()
        saver.prepare(state, config=config)
        allocations = saver.pool.stats().allocations
        pid = saver.worker().pid
        for round_ in range(2):
            expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
            small = [t.clone() for t in state["small"]]
            handle = saver.save(state, tmp_path / f"r{round_}.gdsckpt", codec=codec, config=config)
            state["bf16"].add_(1)  # changed right after the call
            state["fp32"].mul_(-1)
            state["small"][0].zero_()
            report = handle.wait(120)
            assert report.engine == engine
            assert report.backend.startswith("kvikio") == (engine == "gpu"), report.backend
            back = gdsckpt.load(tmp_path / f"r{round_}.gdsckpt", device="cuda")
            for key, tensor in expected.items():
                assert bit_equal(back[key].cpu(), tensor.cpu()), key
            assert all(bit_equal(a.cpu(), b.cpu()) for a, b in zip(back["small"], small))
            assert back["step"] == 7
        assert saver.worker().pid == pid and saver.pool.stats().allocations == allocations
    finally:
        saver.close_worker()
