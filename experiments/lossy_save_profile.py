"""Where a lossy save's time goes on the GPU engine (issue 7): the fp32 AdamW moments of a
TinyGPT saved with ``lossy={"*": rel}`` under ANS, with Bitcomp's lossy streams (the default)
and without (``LossyPolicy(bitcomp=False)``), each saved once to warm up and then measured:
the seconds of each save, the distinct grid steps, the wall time spent inside the engine's main
calls (summed over calls, from whichever thread: the GPU engine's work runs in its worker, which
cProfile would not see), and the main thread's top functions by own time.

    python3 experiments/lossy_save_profile.py --rel 1e-2
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path


import torch

import gdsckpt
from model import build_training
from call_timer import print_spent, spent, timed
from gdsckpt.codecs import gpu_crc
from gdsckpt.codecs.nvcomp import DeviceCodec
from gdsckpt.lossy import RoundedSource, plan_rounding
from gdsckpt.pipeline.gpu_engine import GpuEngine

TIMED = [(GpuEngine, "_encode_bitcomp_lossy"), (GpuEngine, "_encode_codec"), (GpuEngine, "_planes_smaller"),
         (DeviceCodec, "__init__"), (DeviceCodec, "encode_into"), (DeviceCodec, "decode_into"),
         (RoundedSource, "device_bytes"), (gpu_crc, "crc32c_batch")]
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
    for owner, name in TIMED:
        timed(owner, name)
    steps = {plan_rounding(v, "grid", args.rel).step for v in moments.values()}
    print(f"{len(moments)} tensors, {sum(v.numel() * 4 for v in moments.values()) / 1e9:.2f} GB, "
          f"{len(steps)} distinct grid steps")
    with tempfile.TemporaryDirectory(dir="/root" if Path("/root").is_dir() else None) as where:
        for label, bitcomp in (("bitcomp", True), ("planes", False)):
            policy = gdsckpt.LossyPolicy({"*": args.rel}, bitcomp=bitcomp)
            path = Path(where) / f"{label}.gdsckpt"
            gdsckpt.save(moments, path, codec="ans", lossy=policy)
            spent.clear()
            profile = cProfile.Profile()
            started = time.perf_counter()
            profile.enable()
            report = gdsckpt.save(moments, path, codec="ans", lossy=policy)
            profile.disable()
            print(f"== {label}: {time.perf_counter() - started:.3f} s, ratio {report.ratio:.2f}, {report.chains}")
            print_spent()
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
