"""Which delta transform would code the bf16 weights of two checkpoints 10 AdamW steps apart best
(issue 7's ">= 5x" target): the XOR of the bit patterns (``xorbase/1``, what gdsckpt stores)
against the zigzag-coded integer difference of the bit patterns. Both as byte planes, measured by
their order-0 entropy (the bound for an order-0 coder such as ANS) and by Zstd level 3. CPU only.

A TinyGPT (vocab 8192, 16 heads, batch 4 x 128 tokens, AdamW lr 1e-4, as experiments/delta_bench.py)
trains 50 steps, then 10 more; the bf16 casts of its weights before and after are compared.

    python3 experiments/delta_transform_entropy.py --width 1024 --depth 4
"""

from __future__ import annotations

import argparse
import time


import numpy as np
import torch
import zstandard

from gdsckpt.demo import TinyGPT, train_steps


def entropy_bytes(data: np.ndarray) -> float:
    """Order-0 entropy of a uint8 array, in bytes."""
    counts = np.bincount(data, minlength=256).astype(np.float64)
    p = counts[counts > 0] / data.size
    return float(-(p * np.log2(p)).sum() * data.size / 8)


def planes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """High and low byte planes of a uint16 array."""
    pairs = values.view(np.uint8).reshape(-1, 2)
    return pairs[:, 1].copy(), pairs[:, 0].copy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyGPT(vocab=8192, width=args.width, depth=args.depth, heads=16, context=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    started = time.perf_counter()
    train_steps(model, optimizer, 50, seed=0, batch=4, length=128)
    before = {n: p.detach().to(torch.bfloat16).view(torch.int16).numpy().copy() for n, p in model.named_parameters()}
    train_steps(model, optimizer, 10, seed=1, batch=4, length=128)
    after = {n: p.detach().to(torch.bfloat16).view(torch.int16).numpy().copy() for n, p in model.named_parameters()}
    zstd = zstandard.ZstdCompressor(level=3)
    raw, coded = 0, {}
    for name in before:
        x, y = before[name].view(np.uint16), after[name].view(np.uint16)
        difference = y.astype(np.int32) - x.astype(np.int32)
        zigzag = (((difference << 1) ^ (difference >> 31)) & 0xFFFF).astype(np.uint16)
        raw += x.nbytes
        for label, values in (("xor", x ^ y), ("zigzag difference", zigzag)):
            high, low = planes(values)
            coded[f"{label}, order-0 entropy"] = coded.get(f"{label}, order-0 entropy", 0) + \
                entropy_bytes(high) + entropy_bytes(low)
            coded[f"{label}, Zstd"] = coded.get(f"{label}, Zstd", 0) + len(zstd.compress(high.tobytes() + low.tobytes()))
    print(f"TinyGPT {args.width}/{args.depth}, bf16 weights 10 steps apart, {raw / 1e6:.1f} MB "
          f"({time.perf_counter() - started:.0f} s)")
    for label, size in coded.items():
        print(f"  {label:36} {raw / size:6.2f}x")


if __name__ == "__main__":
    main()
