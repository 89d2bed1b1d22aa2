"""Why delta saves slow down with the depth of their chain (issue 7), on one GPU: the training
state of experiments/delta_bench.py (TinyGPT ``--width``/``--depth``: bf16 weights, fp32 master
weights, AdamW moments) saved in full, then ``--links`` deltas 10 steps apart, each against the
previous one (a chain, as ``CheckpointManager(delta_every=...)`` writes). For each save: its
seconds (durable), and the wall time spent inside the calls that resolving the base makes
(summed over calls and threads): window restores, engines, readers, nvCOMP.

    python3 experiments/delta_depth_profile.py --links 6
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


import torch

import gdsckpt
from call_timer import print_spent, spent, timed
from model import state_of, training
from gdsckpt import api
from gdsckpt.codecs.nvcomp import DeviceCodec
from gdsckpt.demo import train_steps
from gdsckpt.io import kvikio as kvikio_io
from gdsckpt.pipeline import gpu_engine

TIMED = [(api.Checkpoint, "_read_many"), (api, "_open_base"), (gpu_engine.GpuEngine, "__init__"),
         (gpu_engine.GpuEngine, "reserve_reads"), (gpu_engine.GpuEngine, "close"), (api, "run_restore"),
         (kvikio_io.KvikioReader, "__init__"), (DeviceCodec, "__init__"), (DeviceCodec, "decode_into"),
         (DeviceCodec, "encode_into")]
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--links", type=int, default=6)
    args = parser.parse_args()
    model, optimizer = training(args.width, args.depth, 50)
    for owner, name in TIMED:
        timed(owner, name)
    with tempfile.TemporaryDirectory(dir="/root" if Path("/root").is_dir() else None) as where:
        previous = None
        for link in range(args.links + 1):
            if link:
                train_steps(model, optimizer, 10, seed=link, batch=4, length=128)
            state = state_of(model, optimizer)
            path = Path(where) / f"{link}.gdsckpt"
            spent.clear()
            started = time.perf_counter()
            report = gdsckpt.save(state, path, base=previous, max_chain=args.links + 1)
            seconds = time.perf_counter() - started
            print(f"== link {link} (its base is a delta {max(link - 1, 0)} deep): {seconds:.2f} s, "
                  f"{report.file_bytes / 2**20:.0f} MiB, {report.delta_tensors} delta arrays")
            print_spent()
            previous = path
            del state
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
