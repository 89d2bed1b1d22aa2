"""Targets whose memory overlaps (tied weights, views of one storage) in ``load_into``.

A restore into overlapping targets must fill them as torch's ``load_state_dict`` would: key by
key in the target's order, so where memory is shared the LAST key wins, for every byte,
deterministically, whatever order the parallel reads land in. And no chunk's checksum may be
checked over memory that a read of another key can write: an intact file is never reported
corrupt (which would make ``CheckpointManager.restore_latest`` skip a good checkpoint).

The files hold random bit patterns (NaN payloads and -0.0 included), incompressible, so both
``codec="none"`` and the CPU engine's ``"auto"`` store them as ``none/1`` chunks, which the
restore reads straight into the destination memory.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import gdsckpt
from gdsckpt.pipeline import engine as engine_module
from gdsckpt.pipeline import load as load_module
from gdsckpt.state import TorchTarget

ROWS, WIDTH = 48, 64  # 12 KiB float32 arrays: 3 chunks of 4096 bytes each (several with smaller chunks)


def _random_bits(seed: int, shape: tuple[int, ...] = (ROWS, WIDTH)) -> torch.Tensor:
    """Random float32 bit patterns: incompressible, with NaN payloads, infinities and -0.0."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, generator=g)
    nan_payload, negative_zero, infinity = 0x7FC01234, -0x80000000, 0x7F800000
    bits.view(-1)[:3] = torch.tensor([nan_payload, negative_zero, infinity], dtype=torch.int32)
    return bits.view(torch.float32)


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()


class _Tied(torch.nn.Module):
    """An embedding and an output head that share one weight (state_dict: embed, then head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(ROWS, WIDTH)
        self.head = torch.nn.Linear(WIDTH, ROWS, bias=False)
        self.head.weight = self.embed.weight


class _Windowed(torch.nn.Module):
    """A weight and, in a submodule before it, a buffer that is a slice of its rows (state_dict:
    first.window, then second.weight, which overwrites the window)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Module(), torch.nn.Module()
        self.second.weight = torch.nn.Parameter(torch.zeros(ROWS, WIDTH))
        self.first.register_buffer("window", self.second.weight.data[4:20])


def _torch_reference(base: torch.Tensor, target: dict[str, torch.Tensor],
                     stored: dict[str, torch.Tensor]) -> bytes:
    """What ``load_state_dict`` leaves in ``base``: ``copy_`` key by key in target order, on a
    clone of ``base`` (the targets' tensors that share its storage are all views of it)."""
    clone = base.detach().clone()
    for key, tensor in target.items():
        if tensor.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
            offset = tensor.storage_offset() - base.storage_offset()
            clone.as_strided(tensor.shape, tensor.stride(), offset).copy_(stored[key])
    return _bits(clone)


@pytest.mark.parametrize("codec", ["none", "auto"])
@pytest.mark.parametrize("chunk_bytes", [4096, 8192])
def test_tied_target_restores_the_last_key_without_false_corruption(codec: str, chunk_bytes: int,
                                                                    tmp_path: Path, h: Any) -> None:
    config = h.small_config(chunk_bytes=chunk_bytes)
    reference = _Tied()
    for run in range(10):  # the reads race: before the fix most runs reported a checksum mismatch
        stored = {"embed.weight": _random_bits(2 * run), "head.weight": _random_bits(2 * run + 1)}
        path = tmp_path / f"run{run}.gdsckpt"
        gdsckpt.save({"model": stored}, path, codec=codec, config=config)
        index = h.read_index(path)
        assert all(index.chains[c.chain] == [{"name": "none/1"}] for c in index.chunks)
        model = _Tied()
        gdsckpt.load_into({"model": model}, path, config=config)
        reference.load_state_dict(stored)
        assert _bits(model.embed.weight) == _bits(reference.embed.weight) == _bits(stored["head.weight"])
        assert model.head.weight is model.embed.weight


@pytest.mark.parametrize("order", ["whole_first", "views_first"])
def test_partially_overlapping_views_fill_key_by_key(order: str, ckpt_path: Path, h: Any) -> None:
    config = h.small_config()
    base = torch.zeros(ROWS, WIDTH)
    views = {
        "whole": base,
        "rows": base[5:20],  # contiguous slice
        "columns": base[:, 10:30],  # non-contiguous view: filled through a copy
        "transposed": base.t()[3:40],  # non-contiguous, different shape
        "flat_tail": base.view(-1)[ROWS * WIDTH - 1000:],  # contiguous, last 1000 elements
    }
    keys = list(views) if order == "whole_first" else list(views)[1:] + ["whole"]
    target = {key: views[key] for key in keys}
    stored = {key: _random_bits(i, tuple(views[key].shape)) for i, key in enumerate(views)}
    gdsckpt.save(stored, ckpt_path, codec="none", config=config)
    expected = _torch_reference(base, target, stored)
    for _ in range(4):
        base.zero_()
        gdsckpt.load_into(target, ckpt_path, config=config)
        assert _bits(base) == expected


@pytest.mark.parametrize("first_row", [0, 2])
def test_checkpoint_alias_into_overlapping_targets(first_row: int, ckpt_path: Path, h: Any) -> None:
    """The checkpoint ties ``a`` and ``b`` (``b`` is stored as an alias); the target ties ``b``
    and ``c`` instead (exactly, or ``c`` as rows ``first_row:`` of ``b``): ``a`` gets its own
    array, the ``b``/``c`` memory what ``load_state_dict`` would leave there."""
    config = h.small_config()
    shared, other = _random_bits(1), _random_bits(2, (ROWS - first_row, WIDTH))
    gdsckpt.save({"a": shared, "b": shared, "c": other}, ckpt_path, codec="none", config=config)
    assert h.read_index(ckpt_path).tensors[1].alias == 0
    for order in (["a", "b", "c"], ["a", "c", "b"], ["c", "b", "a"]):
        a, tied = torch.zeros(ROWS, WIDTH), torch.zeros(ROWS, WIDTH)
        slots = {"a": a, "b": tied, "c": tied[first_row:]}
        target = {key: slots[key] for key in order}
        expected = _torch_reference(tied, target, {"a": shared, "b": shared, "c": other})
        gdsckpt.load_into(target, ckpt_path, config=config)
        assert _bits(a) == _bits(shared)
        assert _bits(tied) == expected, order


@pytest.mark.parametrize("model_class", [_Tied, _Windowed])
def test_manager_restores_the_newest_step_into_shared_memory(model_class: type, tmp_path: Path,
                                                              h: Any) -> None:
    config = h.small_config()
    manager = gdsckpt.CheckpointManager(tmp_path / "ckpts", config=config)
    shapes = {key: tuple(value.shape) for key, value in model_class().state_dict().items()}
    saved = {step: {key: _random_bits(10 * step + n, shape) for n, (key, shape) in enumerate(shapes.items())}
             for step in (1, 2)}
    for step, stored in saved.items():
        manager.save(step, {"model": stored}, codec="none")
    reference = model_class()
    reference.load_state_dict(saved[2])
    for _ in range(4):
        model = model_class()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a skipped checkpoint warns: that is the failure
            restored = manager.restore_latest(model=model)
        assert restored == (2, {})
        for key, tensor in model.state_dict().items():
            assert _bits(tensor) == _bits(reference.state_dict()[key]), key


def test_direct_reads_exclude_overlapping_targets_only(ckpt_path: Path, h: Any) -> None:
    """``_whole_chunk_views`` never reads or decodes into memory another target of the same
    restore covers; targets that merely touch (adjacent halves of one buffer) keep their direct
    reads."""
    gdsckpt.save({"x": _random_bits(1), "y": _random_bits(2)}, ckpt_path, codec="none",
                 config=h.small_config())
    index = h.read_index(ckpt_path)
    deliveries: dict[int, list[Any]] = {}
    for array_id, record in enumerate(index.tensors):
        for segment in record.segments:
            deliveries[segment.chunk] = [(array_id, 0, segment.length, segment.raw_offset)]
    engine = type("CpuEngine", (), {"name": "cpu"})()

    def direct_for(x: torch.Tensor, y: torch.Tensor) -> dict[int, Any]:
        targets = {0: TorchTarget((ROWS, WIDTH), "float32", "cpu", existing=x),
                   1: TorchTarget((ROWS, WIDTH), "float32", "cpu", existing=y)}
        return load_module._whole_chunk_views(index, engine, targets, deliveries)

    flat = torch.zeros(2, ROWS, WIDTH)
    assert len(direct_for(flat[0], flat[1])) == len(index.chunks), "adjacent is not overlapping"
    tied = torch.zeros(ROWS, WIDTH)
    assert direct_for(tied, tied) == {}
    shifted = torch.zeros(ROWS * WIDTH + WIDTH).view(-1)
    x, y = shifted[:ROWS * WIDTH].view(ROWS, WIDTH), shifted[WIDTH:].view(ROWS, WIDTH)
    assert direct_for(x, y) == {}, "a one-row overlap excludes both"


def test_untied_targets_still_read_directly(ckpt_path: Path, monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    config = h.small_config()
    stored = {"embed.weight": _random_bits(3), "head.weight": _random_bits(4)}
    gdsckpt.save({"model": stored}, ckpt_path, codec="none", config=config)
    buffers = []
    original = engine_module.HostEngine.read_buffer

    def counting_read_buffer(engine: Any, nbytes: int) -> Any:
        buffers.append(nbytes)
        return original(engine, nbytes)

    monkeypatch.setattr(engine_module.HostEngine, "read_buffer", counting_read_buffer)
    untied = {"embed.weight": torch.zeros(ROWS, WIDTH), "head.weight": torch.zeros(ROWS, WIDTH)}
    gdsckpt.load_into({"model": untied}, ckpt_path, config=config)
    assert buffers == [], "every chunk was read straight into its tensor"
    assert all(_bits(untied[key]) == _bits(stored[key]) for key in stored)
    # tied: the earlier key is overwritten whole, so only the last one is read, also directly
    model = _Tied()
    gdsckpt.load_into({"model": model}, ckpt_path, config=config)
    assert buffers == []
    assert _bits(model.embed.weight) == _bits(stored["head.weight"])
    # saved from the tied model: stored once (an alias), read once, directly
    gdsckpt.save({"model": model.state_dict()}, ckpt_path, codec="none", config=config)
    tied = _Tied()
    gdsckpt.load_into({"model": tied}, ckpt_path, config=config)
    assert buffers == []
    assert _bits(tied.embed.weight) == _bits(stored["head.weight"])
