"""The synthetic training state the benchmark saves: layer shapes, the tensors, the bit-exact check.
"""

from __future__ import annotations

import math
from typing import Any

from .results import DATA_DESCRIPTION

# ---------------------------------------------------------------------------------------------
# the data

def _layer_shapes(params: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a GPT-style block stack holding exactly ``params`` parameters.

    The width grows with the state (at least two blocks), so the large matrices of a 1 GiB state
    (~44 MiB in fp32) span several chunks of any usual chunk size, as those of a real model do."""
    width = max(64, min(8192, int(math.sqrt(params / 24)) // 128 * 128))
    spec = [("norm1.weight", (width,)), ("norm1.bias", (width,)), ("qkv.weight", (3 * width, width)),
            ("qkv.bias", (3 * width,)), ("proj.weight", (width, width)), ("proj.bias", (width,)),
            ("norm2.weight", (width,)), ("norm2.bias", (width,)), ("fc1.weight", (4 * width, width)),
            ("fc1.bias", (4 * width,)), ("fc2.weight", (width, 4 * width)), ("fc2.bias", (width,))]
    shapes: list[tuple[str, tuple[int, ...]]] = []
    remaining, block = params, 0
    while remaining > 0:
        for name, shape in spec:
            count = math.prod(shape)
            if count >= remaining:  # the last tensor takes exactly what is left
                shapes.append((f"blocks.{block}.{name}", (remaining,) if count > remaining else shape))
                return shapes
            shapes.append((f"blocks.{block}.{name}", shape))
            remaining -= count
        block += 1
    return shapes


def logical_bytes_for(size_bytes: int) -> int:
    """The tensor bytes of ``synthetic_state(size_bytes)``: whole parameters of 14 bytes each."""
    return max(1, size_bytes // 14) * 14


def synthetic_state(nbytes: int, *, seed: int = 0) -> dict[str, Any]:
    """A mixed-precision training state of at most ``nbytes`` tensor bytes, in host memory.

    ``{"model": {name: bf16}, "master": {name: fp32}, "optimizer": {name: {"exp_avg", "exp_avg_sq"}},
    "step": int}``, deterministic in ``seed``. Drawn rather than trained so any size is quick to
    make; codec auto on the CPU stores it at ratios close to those of the trained GPT state of
    docs/performance.md (measured at 256 MiB: whole 1.24, bf16 1.49, fp32 groups 1.20-1.21; the
    trained state: 1.25, 1.55, 1.19-1.23).
    """
    import torch

    params = logical_bytes_for(nbytes) // 14
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {"model": {}, "master": {}, "optimizer": {}, "step": 100}
    for name, shape in _layer_shapes(params):
        master = torch.randn(shape, generator=generator).mul_(0.02)
        if "norm" in name and name.endswith("weight"):
            master.add_(1.0)
        grad = torch.randn(shape, generator=generator).mul_(1e-3)
        # exp_avg_sq averages squared gradients of several steps: a sum of two squares is closer to
        # a trained optimizer's spread of exponents (and ratio) than one square.
        older = torch.randn(shape, generator=generator).mul_(1e-3)
        state["model"][name] = master.to(torch.bfloat16)
        state["master"][name] = master
        state["optimizer"][name] = {"exp_avg": grad.mul(0.1),
                                    "exp_avg_sq": grad.square().add_(older.square()).mul_(5e-4)}
    return state


def flat_tensors(state: Any, prefix: str = "") -> dict[str, Any]:
    """The tensors of a nested dict keyed ``a/b/c`` (plain values left out)."""
    import torch

    out: dict[str, Any] = {}
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_tensors(value, path + "/"))
        elif isinstance(value, torch.Tensor):
            out[path] = value
    return out


def same_bits(expected: dict[str, Any], actual: dict[str, Any]) -> bool:
    """Same keys, dtypes, shapes and bit patterns (compared on the expected tensor's device)."""
    import torch

    if expected.keys() != actual.keys():
        return False
    for key, want in expected.items():
        got = actual[key]
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            return False
        if not _equal_bytes(want.reshape(-1).view(torch.uint8),
                            got.to(want.device).reshape(-1).contiguous().view(torch.uint8)):
            return False
    return True


def _equal_bytes(a: Any, b: Any) -> bool:
    """Two 1-D uint8 tensors of one length hold the same bytes. Compared as int64 words where the
    storage offsets allow it: torch compares uint8 tensors ~500x slower (measured on the CPU)."""
    import torch

    words = a.numel() // 8 * 8
    try:
        if not torch.equal(a[:words].view(torch.int64), b[:words].view(torch.int64)):
            return False
    except RuntimeError:  # a storage offset that is not a multiple of 8 bytes
        return bool(torch.equal(a, b))
    return bool(torch.equal(a[words:], b[words:]))


def describe_data(state: dict[str, Any], seed: int) -> dict[str, Any]:
    """Sizes of the synthetic state, for the report."""
    tensors = flat_tensors(state)
    by_dtype: dict[str, int] = {}
    for tensor in tensors.values():
        name = str(tensor.dtype).replace("torch.", "")
        by_dtype[name] = by_dtype.get(name, 0) + tensor.numel() * tensor.element_size()
    return {"kind": "synthetic", "description": DATA_DESCRIPTION, "seed": seed,
            "logical_bytes": sum(by_dtype.values()), "tensors": len(tensors), "bytes_by_dtype": by_dtype,
            "largest_tensor_bytes": max(t.numel() * t.element_size() for t in tensors.values())}
