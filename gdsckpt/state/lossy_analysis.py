"""Tools for choosing a lossy policy (``gdsckpt.lossy``): how the grid compares with blockwise
8-bit quantization on an array (``compare_modes``), and how much a model's loss moves when chosen
tensors are rounded (``sensitivity``). Saving and loading never call them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .lossy import (
    FLOAT_DTYPES,
    LossyPolicy,
    checked_rel,
    float_dtype_name,
    grid_quantize,
    key_matches,
    quantize_whole,
)


def _zstd_bytes(data: np.ndarray, width: int) -> int:
    """Bytes zstd (level 1, as the CPU engine) takes for ``data``: the smaller of one frame and
    one frame per byte plane, as the engine's byte-plane trial chooses."""
    import zstandard

    from ..codecs.cpu import HOST_ZSTD_LEVEL, planes_forward

    compressor = zstandard.ZstdCompressor(level=HOST_ZSTD_LEVEL)
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    plain = len(compressor.compress(data.data))
    if width < 2 or data.size % width:
        return plain
    planes = planes_forward(data, width).reshape(width, -1)
    return min(plain, sum(len(compressor.compress(np.ascontiguousarray(plane).data)) for plane in planes))


def _as_numpy(array: Any) -> np.ndarray:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        array = array.detach().cpu()
        if array.dtype == torch.bfloat16:
            # NumPy has no bfloat16 without ml_dtypes: keep the bits (for the grid's stored bytes)
            return array.view(torch.int16).numpy()
        return array.numpy()
    return np.asarray(array)


def compare_modes(array: Any, rel: float, *, block: int = 256) -> dict[str, Any]:
    """Estimate what grid rounding at ``rel`` and blockwise 8-bit quantization would store for one
    floating array, both compressed with zstd (an in-memory analysis: no file holds the 8-bit form).

    8-bit (``q8``): per block of ``block`` elements, ``scale = max|x| / 127`` (float32) and int8
    codes ``round(x / scale)``; its error is at most ``scale / 2`` per block, which need not meet
    the grid's ``abs_bound`` (``q8_within_bound`` says). Non-finite elements count as 0 for q8.
    Returns raw, grid and q8 byte counts, ratios and measured max errors.
    """
    grid = grid_quantize(array, rel)
    raw = _as_numpy(array)
    itemsize = raw.dtype.itemsize
    values = _as_numpy(grid.values) if grid is not None else raw
    grid_bytes = _zstd_bytes(values, itemsize)

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        x = array.detach().to("cpu", torch.float64).reshape(-1).numpy()
    else:
        x = np.asarray(array, dtype=np.float64).reshape(-1)
    x = np.where(np.isfinite(x), x, 0.0)
    padded = np.zeros(-(-x.size // block) * block, dtype=np.float64)
    padded[:x.size] = x
    blocks = padded.reshape(-1, block)
    scales = (np.abs(blocks).max(axis=1) / 127).astype(np.float32)
    divisor = np.where(scales > 0, scales, 1).astype(np.float64)[:, None]
    codes = np.clip(np.round(blocks / divisor), -127, 127).astype(np.int8)
    decoded = codes.astype(np.float64) * scales.astype(np.float64)[:, None]
    q8_error = float(np.abs(decoded - blocks).max()) if blocks.size else 0.0
    q8_bytes = _zstd_bytes(codes, 1) + _zstd_bytes(scales, 4)

    nbytes = raw.nbytes
    abs_bound = grid.abs_bound if grid is not None else 0.0
    return {
        "raw_bytes": nbytes, "rel_bound": rel, "abs_bound": abs_bound, "block": block,
        "grid_bytes": grid_bytes, "grid_ratio": nbytes / grid_bytes if grid_bytes else 0.0,
        "grid_max_error": grid.max_error if grid is not None else 0.0,
        "q8_bytes": q8_bytes, "q8_ratio": nbytes / q8_bytes if q8_bytes else 0.0,
        "q8_max_error": q8_error, "q8_within_bound": q8_error <= abs_bound,
    }


# ---------------------------------------------------------------------------------------------
# sensitivity of a model's loss

@dataclass(frozen=True)
class Sensitivity:
    """How the loss moved when one group of a model's tensors was grid-rounded at one bound."""

    group: str
    rel_bound: float
    keys: tuple[str, ...]
    """The state_dict keys rounded (empty: the group matched no floating tensor)."""
    base_loss: float
    loss: float
    rel_change: float
    """``(loss - base_loss) / |base_loss|`` (the plain difference when ``base_loss`` is 0)."""
    max_error: float
    """The largest measured ``max_error`` among the group's tensors."""


_WILDCARDS = frozenset("*?[")


def _groups(spec: Any) -> list[tuple[str, list[str], float | None, str]]:
    """(name, patterns, own bound or None, mode) of each group of ``sensitivity``."""
    if isinstance(spec, LossyPolicy) or (isinstance(spec, Mapping) and spec
                                         and all(isinstance(v, (int, float, tuple)) for v in spec.values())):
        policy = LossyPolicy.of(spec)
        return [(pattern, [pattern], rule[1], rule[0]) for pattern, rule in policy.checked_rules()]
    if isinstance(spec, Mapping):
        return [(str(name), [patterns] if isinstance(patterns, str) else list(patterns), None, "grid")
                for name, patterns in spec.items()]
    if isinstance(spec, str) or not isinstance(spec, Iterable):
        raise TypeError("groups must be a LossyPolicy, a dict of pattern -> bound, a dict of name -> "
                        "patterns, or a list of patterns / key prefixes")
    # A plain name is a prefix: "blocks.0" covers "blocks.0.qkv.weight", ...
    return [(p, [p] if _WILDCARDS & set(p) else [p, p + ".*", p + "/*"], None, "grid") for p in spec]


def sensitivity(model: Any, loss_fn: Callable[[Any, Any], Any], batch: Any, groups: Any,
                rel_bounds: Iterable[float] | None = (1e-2, 1e-3)) -> list[Sensitivity]:
    """For each group of ``model``'s floating state_dict tensors and each bound: round that group
    to its grid form (``grid_quantize``), evaluate ``loss_fn(model, batch)`` (under
    ``torch.no_grad``), restore the originals (bit-exact), and report the loss's relative change.

    ``groups``: a ``LossyPolicy`` or dict of pattern -> bound (a group per pattern), a dict of
    name -> pattern(s), or a list of patterns / key prefixes (``"blocks.0"``); patterns match
    state_dict keys as in ``LossyPolicy``. ``rel_bounds``: the bounds to try; None uses each
    pattern's own bound (policies only). Put the model in ``eval()`` mode first if it has dropout,
    or the loss moves by itself. Returns one ``Sensitivity`` per group and bound, in that order.
    """
    import torch

    entries = [(key, tensor) for key, tensor in model.state_dict().items()
               if isinstance(tensor, torch.Tensor) and float_dtype_name(tensor) in FLOAT_DTYPES]
    bounds = None if rel_bounds is None else [checked_rel(rel, "rel_bounds") for rel in rel_bounds]
    with torch.no_grad():
        base = float(loss_fn(model, batch))
    results = []
    for name, patterns, own, mode in _groups(groups):
        members = [(key, tensor) for key, tensor in entries if any(key_matches(p, key) for p in patterns)]
        if bounds is None and own is None:
            raise ValueError(f"group {name!r} has no bound of its own: give rel_bounds")
        for rel in (bounds if bounds is not None else [own]):
            assert rel is not None
            keys, worst, loss = [], 0.0, base
            if members:
                # Every original is copied before anything is written: tied tensors (one memory
                # under two keys) come back as they were.
                originals = [tensor.detach().clone() for _key, tensor in members]
                try:
                    with torch.no_grad():
                        for key, tensor in members:
                            result = quantize_whole(tensor, rel, mode)
                            if result is not None:
                                tensor.copy_(result.values)
                                keys.append(key)
                                worst = max(worst, result.max_error)
                        loss = float(loss_fn(model, batch))
                finally:
                    with torch.no_grad():
                        for (_key, tensor), original in zip(members, originals):
                            tensor.copy_(original)
            change = (loss - base) / abs(base) if base else loss - base
            results.append(Sensitivity(name, rel, tuple(keys), base, loss, change, worst))
    return results


__all__ = ["Sensitivity", "compare_modes", "sensitivity"]
