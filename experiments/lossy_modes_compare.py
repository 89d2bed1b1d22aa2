"""Grid rounding against blockwise 8-bit quantization at the same error bound, on AdamW moments
(issue 7: "blockwise 8-bit quantization where that compresses better for the same bound").
CPU only: ``gdsckpt.lossy.compare_modes`` on every fp32 ``exp_avg`` / ``exp_avg_sq`` of a TinyGPT
trained 20 steps (as experiments/bitcomp_lossy_compare.py), both forms compressed with Zstd.

Per bound: the ratio of each form, of the smaller form per tensor where 8-bit is within the
grid's ``abs_bound`` ("best"), and the tensors where 8-bit is within the bound and smaller (the
only ones where a save could prefer it), by moment.

    python3 experiments/lossy_modes_compare.py --width 1024 --depth 4
"""

from __future__ import annotations

import argparse
import time


import torch

from gdsckpt.demo import TinyGPT, train_steps
from gdsckpt.lossy import compare_modes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bounds", default="1e-2,1e-3")
    parser.add_argument("--block", type=int, default=256)
    args = parser.parse_args()
    started = time.perf_counter()
    torch.manual_seed(0)
    model = TinyGPT(vocab=8192, width=args.width, depth=args.depth, heads=16, context=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_steps(model, optimizer, args.steps, seed=0, batch=4, length=128)
    moments = {f"{i}.{name}": value for i, state in enumerate(optimizer.state.values())
               for name, value in state.items() if name in ("exp_avg", "exp_avg_sq")}
    print(f"TinyGPT {args.width}/{args.depth}, {args.steps} steps: {len(moments)} moments, "
          f"{sum(v.numel() * 4 for v in moments.values()) / 1e6:.0f} MB fp32, blocks of {args.block}")
    print(f"  {'rel':>6} {'grid+zstd':>10} {'q8+zstd':>9} {'best':>7} {'q8 within bound':>16} "
          f"{'q8 within and smaller':>22}  (exp_avg / exp_avg_sq)")
    for rel in (float(b) for b in args.bounds.split(",")):
        raw = grid = q8 = best = 0
        within = 0
        better = {"exp_avg": 0, "exp_avg_sq": 0}
        for key, value in moments.items():
            row = compare_modes(value, rel, block=args.block)
            raw += row["raw_bytes"]
            grid += row["grid_bytes"]
            q8 += row["q8_bytes"]
            within += row["q8_within_bound"]
            smaller = row["q8_within_bound"] and row["q8_bytes"] < row["grid_bytes"]
            better[key.split(".", 1)[1]] += smaller
            best += row["q8_bytes"] if smaller else row["grid_bytes"]
        print(f"  {rel:>6g} {raw / grid:>9.2f}x {raw / q8:>8.2f}x {raw / best:>6.2f}x {within:>9d} of {len(moments):<4d}"
              f" {sum(better.values()):>15d} of {len(moments):<4d}  ({better['exp_avg']} / {better['exp_avg_sq']})")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
