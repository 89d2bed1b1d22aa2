"""Delta checkpoints on the GPU (issue 7): XOR with the base computed on the device, chains
resolved on the device, GPU-written deltas read on the CPU engine and the other way round.

Run on a GPU host with:  python3 -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from gdsckpt.codecs.nvcomp import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs CUDA, CuPy and nvCOMP")]

import gdsckpt
from gdsckpt.demo import bit_equal
from gdsckpt.state import delta as delta_module


def _states(count: int, device: str = "cuda") -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(1 << 20, device=device, generator=g) * 0.02
    moment = torch.randn(1 << 19, device=device, generator=g) * 1e-3
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45], device=device)
    states = []
    for step in range(count):
        weight = weight - 1e-4 * torch.randn(weight.shape, device=device, generator=g)
        moment = 0.9 * moment + 1e-5 * torch.randn(moment.shape, device=device, generator=g)
        states.append({"model": {"w": weight.to(torch.bfloat16), "master": weight.clone(),
                                 "special": special.clone(), "ids": torch.arange(100, device=device),
                                 "tiny": [torch.full((3,), float(i + step), device=device) for i in range(20)]},
                       "optimizer": {"exp_avg": moment.clone()}, "step": step})
    return states


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and bit_equal(a.cpu(), b.cpu())
    return a == b


@pytest.mark.parametrize("codec", ["ans", "zstd"])
def test_gpu_delta_chain_round_trips(tmp_path, codec):
    states = _states(4)
    paths = [tmp_path / f"c{i}.gdsckpt" for i in range(4)]
    # zstd on CUDA state would run the CPU engine; nvCOMP's needs ~1.1 GiB of scratch
    gpu = gdsckpt.Config(engine="gpu", max_staging_bytes=2 << 30)
    reports = [gdsckpt.save(states[0], paths[0], codec=codec, config=gpu)]
    for i in range(1, 4):
        reports.append(gdsckpt.save(states[i], paths[i], codec=codec, base=paths[i - 1], config=gpu))
    assert all(r.engine == "gpu" for r in reports)
    assert [r.delta_tensors > 0 for r in reports] == [False, True, True, True]
    for state, path in zip(states, paths):
        loaded = gdsckpt.load(path, device="cuda")
        assert loaded["model"]["w"].is_cuda and _equal(loaded, state)
    with gdsckpt.open(paths[3]) as checkpoint:
        assert bit_equal(checkpoint.get_rows("model/master", 100, 70_000, device="cuda").cpu(),
                         states[3]["model"]["master"][100:70_000].cpu())
    # a delta of bf16 weights compresses far better than the weights
    full = {t.key: t for t in gdsckpt.inspect(paths[0]).tensors}
    delta = {t.key: t for t in gdsckpt.inspect(paths[1]).tensors}
    print(f"\n{codec}: bf16 weights full {full['model/w'].stored_bytes} B, delta {delta['model/w'].stored_bytes} B")
    assert delta["model/w"].stored_bytes < full["model/w"].stored_bytes


def test_gpu_written_portable_delta_loads_on_the_cpu_engine_and_back(tmp_path):
    states = _states(2)
    gdsckpt.save(states[0], tmp_path / "a.gdsckpt", codec="zstd")
    gdsckpt.save(states[1], tmp_path / "b.gdsckpt", codec="zstd", base=tmp_path / "a.gdsckpt")
    cpu = gdsckpt.Config(engine="cpu")
    assert _equal(gdsckpt.load(tmp_path / "b.gdsckpt", config=cpu), states[1])
    host = [{k: v for k, v in s.items()} for s in _states(2, device="cpu")]
    gdsckpt.save(host[0], tmp_path / "h0.gdsckpt", codec="zstd")
    gdsckpt.save(host[1], tmp_path / "h1.gdsckpt", codec="zstd", base=tmp_path / "h0.gdsckpt")
    assert _equal(gdsckpt.load(tmp_path / "h1.gdsckpt", device="cuda"), host[1])


def test_gpu_delta_windows_smaller_than_the_arrays(tmp_path, monkeypatch):
    monkeypatch.setattr(delta_module, "DEVICE_WINDOW_BYTES", 1 << 20)
    states = _states(2)
    config = gdsckpt.Config(gpu_chunk_bytes=256 << 10)
    gdsckpt.save(states[0], tmp_path / "a.gdsckpt", codec="ans", config=config)
    gdsckpt.save(states[1], tmp_path / "b.gdsckpt", codec="ans", base=tmp_path / "a.gdsckpt", config=config)
    assert _equal(gdsckpt.load(tmp_path / "b.gdsckpt", device="cuda", config=config), states[1])


def test_gpu_async_delta_through_the_manager(tmp_path):
    states = _states(3)
    manager = gdsckpt.CheckpointManager(tmp_path, keep_last=2, delta_every=1, full_every=100)
    manager.save(1, states[0])
    for step, state in ((2, states[1]), (3, states[2])):
        report = manager.save_async(step, state).wait(timeout=120)
        assert report.base == manager.path(step - 1).name
    assert manager.steps() == [1, 2, 3]  # 1 and 2 are bases of the kept 3
    assert _equal(gdsckpt.load(manager.path(3), device="cuda"), states[2])
