"""The GPU save pipeline alone: nvCOMP ANS + byte planes into a null sink (no file, no kvikio), at
4 and 16 MiB chunks, two passes each (the first includes nvCOMP's and CuPy's warm-up). This is
what made 16 MiB the GPU chunk size. Uses gdsckpt internals (``GpuEngine``, ``plan_chunks``,
``run_save``, ``state.flatten`` and ``api.saving.index_template``): no public call saves into
``gdsckpt.io.NullWriter``.

    python3 experiments/gpu_null_sink.py --width 2560 --depth 8
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from model import build_training, state_of

import gdsckpt
from gdsckpt.api.saving import index_template
from gdsckpt.io import NullWriter
from gdsckpt.pipeline.gpu import GpuEncoder
from gdsckpt.pipeline.plan import plan_chunks
from gdsckpt.pipeline.save import run_save
from gdsckpt.state import flatten


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    state = state_of(*build_training(args.width, args.depth, args.steps, "cuda"))
    flat_state = flatten(state)
    logical = sum(a.source.nbytes for a in flat_state.arrays)
    config = gdsckpt.Config()
    runs = {}
    for chunk_mib in (4, 16):
        chunk = chunk_mib << 20
        plans = plan_chunks([(a.source.nbytes, a.source.itemsize, a.source.plane_width) for a in flat_state.arrays],
                            chunk_bytes=chunk, pack_below=config.pack_below)
        for repeat in range(2):
            engine = GpuEncoder([a.source for a in flat_state.arrays], codec="ans", byte_planes="auto", device_id=0,
                               chunk_bytes=chunk, max_staging_bytes=config.max_staging_bytes)
            torch.cuda.synchronize()
            started = time.perf_counter()
            run_save(plans, engine, NullWriter(), max_inflight_bytes=config.max_staging_bytes,
                     index=index_template(flat_state))
            torch.cuda.synchronize()
            engine.close()
            runs[f"null_sink_{chunk_mib}MiB_pass{repeat + 1}_gbps"] = logical / (time.perf_counter() - started) / 1e9
    print(json.dumps({"logical_bytes": logical, "gpu": torch.cuda.get_device_name(0), **runs}, indent=1))


if __name__ == "__main__":
    main()
