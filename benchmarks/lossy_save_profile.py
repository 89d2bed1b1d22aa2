"""Where a lossy save's time goes on the GPU engine (issue 7): the fp32 AdamW moments of a
TinyGPT saved with ``lossy={"*": rel}`` under ANS, with Bitcomp's lossy streams (the default)
and without (``LossyPolicy(bitcomp=False)``), each saved once to warm up and then under cProfile.
Prints the seconds of each save, the distinct grid steps, and the top functions by own time.

    python3 benchmarks/lossy_save_profile.py --rel 1e-2
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

import gdsckpt
from async_bench import build_training  # benchmarks/ is on sys.path
from gdsckpt.lossy import plan_rounding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rel", type=float, default=1e-2)
    parser.add_argument("--top", type=int, default=22)
    args = parser.parse_args()
    _model, optimizer = build_training(args.width, args.depth, 20, torch.device("cuda"))
    moments = {f"{i}.{name}": value for i, state in enumerate(optimizer.state.values())
               for name, value in state.items() if name in ("exp_avg", "exp_avg_sq")}
    steps = {plan_rounding(v, "grid", args.rel).step for v in moments.values()}
    print(f"{len(moments)} tensors, {sum(v.numel() * 4 for v in moments.values()) / 1e9:.2f} GB, "
          f"{len(steps)} distinct grid steps")
    with tempfile.TemporaryDirectory(dir="/root" if Path("/root").is_dir() else None) as where:
        for label, bitcomp in (("bitcomp", True), ("planes", False)):
            policy = gdsckpt.LossyPolicy({"*": args.rel}, bitcomp=bitcomp)
            path = Path(where) / f"{label}.gdsckpt"
            gdsckpt.save(moments, path, codec="ans", lossy=policy)
            profile = cProfile.Profile()
            started = time.perf_counter()
            profile.enable()
            report = gdsckpt.save(moments, path, codec="ans", lossy=policy)
            profile.disable()
            print(f"== {label}: {time.perf_counter() - started:.3f} s, ratio {report.ratio:.2f}, {report.chains}")
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
