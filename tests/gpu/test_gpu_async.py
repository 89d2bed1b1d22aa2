"""GPU variants of the async-save tests: CUDA tensors snapshotted on the GPU or into pinned host
memory, compressed by the GPU engine in the background, bit-exact, taken at call time.

Run on a GPU host with:  python3 -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from gdsckpt.codecs.nvcomp import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs CUDA, CuPy and nvCOMP")]

import gdsckpt
from gdsckpt.background import async_save
from gdsckpt.demo import bit_equal, train_steps, training_state

SNAPSHOT_MODES = {
    # name: (config, pool kind of the CUDA tensors' snapshot buffers, engine expected)
    # zstd on CUDA state runs the CPU engine unless engine="gpu" sends it through nvCOMP, whose
    # Zstd needs a staging budget beyond the default 1 GiB for its ~1.1 GiB of scratch
    "device": (gdsckpt.Config(snapshot_gpu_bytes=1 << 40, engine="gpu", max_staging_bytes=2 << 30), "cuda:0", "gpu"),
    "pinned": (gdsckpt.Config(snapshot_gpu_bytes=0, engine="gpu", max_staging_bytes=2 << 30), "pinned", "gpu"),
    "pinned-cpu-engine": (gdsckpt.Config(snapshot_gpu_bytes=0, engine="cpu"), "pinned", "cpu"),
}


def _state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(1 << 20, device="cuda", generator=g).to(torch.bfloat16)
    return {"w": weight, "tied": weight, "v": torch.randn(333, 77, device="cuda", generator=g).t(),
            "small": [torch.full((i + 1,), float(i), device="cuda") for i in range(20)],
            "nan": torch.tensor([0x7FC0_1234, -0x8000_0000], dtype=torch.int32,
                                device="cuda").view(torch.float32),
            "step": 3}


def _host_copy(state: dict) -> dict:
    return {k: ([t.cpu().clone() for t in v] if isinstance(v, list) else
                v.cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _assert_equal(expected: dict, loaded: dict) -> None:
    for key, value in expected.items():
        if isinstance(value, list):
            assert all(bit_equal(a, b.cpu()) for a, b in zip(value, loaded[key])), key
        elif isinstance(value, torch.Tensor):
            assert bit_equal(value, loaded[key].cpu()), key
        else:
            assert loaded[key] == value


@pytest.mark.parametrize("mode", sorted(SNAPSHOT_MODES))
def test_cuda_snapshot_taken_at_call_time_and_written_by_the_gpu(tmp_path, mode):
    config, kind, engine = SNAPSHOT_MODES[mode]
    state = _state()
    saver = async_save.AsyncSaver()
    path = tmp_path / "cuda.gdsckpt"
    for round_ in range(2):
        expected = _host_copy(state)
        handle = saver.save(state, path, codec="zstd", config=config)
        with torch.no_grad():  # changed right after the call: the file must hold the old values
            state["w"].add_(1)
            state["v"].mul_(3)
            for t in state["small"]:
                t.add_(1)
        report = handle.wait(timeout=120)
        assert report.engine == engine, report
        loaded = gdsckpt.load(path, device="cuda")
        _assert_equal(expected, loaded)
        assert loaded["tied"].data_ptr() == loaded["w"].data_ptr()  # the tie survives the snapshot
        info = gdsckpt.inspect(path)
        assert {t.device for t in info.tensors if t.kind == "torch"} == {"cuda:0"}, round_
    stats = saver.pool.stats()
    assert stats.lent_bytes == 0 and stats.reuses > 0  # the second save reused the first's buffers
    kinds = {key[0] for key in saver.pool._idle}
    assert kinds == {kind}


def test_cuda_async_save_of_a_training_state_resumes_identically(tmp_path):
    model, opt = training_state(width=64, depth=2, steps=3, device="cuda")
    manager = gdsckpt.CheckpointManager(tmp_path / "run", keep_last=2)
    handle = manager.save_async(3, {"model": model.state_dict(), "optimizer": opt.state_dict()})
    train_steps(model, opt, 2, seed=4)  # the live state moves on while the save runs
    handle.wait(timeout=120)
    fresh, _ = training_state(width=64, depth=2, steps=0, device="cuda", seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    restored = manager.restore_latest(model=fresh, optimizer=fresh_opt)
    assert restored is not None and restored[0] == 3
    reference, ref_opt = training_state(width=64, depth=2, steps=3, device="cuda")
    train_steps(reference, ref_opt, 2, seed=4)
    train_steps(fresh, fresh_opt, 2, seed=4)
    for (k, a), (_, b) in zip(reference.state_dict().items(), fresh.state_dict().items()):
        assert bit_equal(a, b), k
