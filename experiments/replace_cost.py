"""What replacing a checkpoint costs a save: the same state saved over the previous file at the same
path, with the old file's storage freed in the background (``gdsckpt.io.release``, the default)
and inside the save (``RELEASE_MIN_BYTES`` raised past the file), next to a save to a new path.

Round-robin over the three, ``--rounds`` rounds, medians; the background release of one round is
waited for (untimed) before the next save, so each save starts from the same storage. Codec
``none``: the file is as large as the state, and the writes, not the codec, are the save.

    python3 experiments/replace_cost.py --size 1GiB --dir /tmp/replace --out replace.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import benchlib


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default="/tmp/gdsckpt-replace")
    parser.add_argument("--out", default="replace.json")
    args = parser.parse_args()

    import torch

    import gdsckpt
    from gdsckpt.io import release

    size = benchlib.parse_size(args.size)
    generator = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(size // 4 // 8, generator=generator) for i in range(8)}
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    target, fresh = directory / "replaced.gdsckpt", directory / "fresh.gdsckpt"
    gdsckpt.save(state, target, codec="none")
    default_min = release.RELEASE_MIN_BYTES
    seconds: dict[str, list[float]] = {"replace_background": [], "replace_inline": [], "new_path": []}
    for _ in range(args.rounds):
        for name in seconds:
            release.RELEASE_MIN_BYTES = 1 << 62 if name == "replace_inline" else default_min
            path = fresh if name == "new_path" else target
            if name == "new_path":
                path.unlink(missing_ok=True)
            os.sync()
            started = time.perf_counter()
            gdsckpt.save(state, path, codec="none")
            seconds[name].append(time.perf_counter() - started)
            assert release.RELEASER.wait(120), "the background release did not finish"
    release.RELEASE_MIN_BYTES = default_min
    logical = sum(t.numel() * t.element_size() for t in state.values())
    result = {"command": sys.argv, "host": benchlib.host_facts(directory), "logical_bytes": logical,
              "seconds": seconds, "median_s": {k: statistics.median(v) for k, v in seconds.items()},
              "gbps": {k: logical / statistics.median(v) / 1e9 for k, v in seconds.items()}}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name, value in result["median_s"].items():
        print(f"{name:20s} {value * 1e3:8.1f} ms  {result['gbps'][name]:6.3f} GB/s")
    fresh.unlink(missing_ok=True)
    target.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
