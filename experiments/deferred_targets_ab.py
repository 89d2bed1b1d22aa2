"""A restore into new CUDA tensors with its destinations made while the first chunks are read
(``pipeline.load.DeferredTargets``, the default of ``gdsckpt.load``) against made before any read.

Builds a state of ``--tensors`` CUDA tensors (bf16 and fp32, ``--size`` in all), saves it once
with the GPU engine into ``--dir`` (read once more so it sits in the page cache), then loads it
``--rounds`` times each way, alternating, in one process; the first load of each way is checked
bit for bit. Prints the medians in ms and GB/s of logical bytes. Uses internals: it patches
``gdsckpt.api.reading.restore_arrays`` to pass ``new_targets=False`` for the eager side.

    python3 experiments/deferred_targets_ab.py --size 8GiB --tensors 600 --rounds 9 --dir /root/ab
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import gdsckpt
from gdsckpt.api import reading


def parse_size(text: str) -> int:
    units = {"MiB": 1 << 20, "GiB": 1 << 30}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def build_state(size: int, count: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    state = {}
    per = size // count
    for i in range(count):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        numel = max(1, per // (2 if dtype == torch.bfloat16 else 4) - 37 * i % 997)
        state[f"model.layers.{i // 6}.part{i % 6}.weight"] = (
            torch.randn(numel, generator=generator, device="cuda") * 0.02).to(dtype)
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="8GiB")
    parser.add_argument("--tensors", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    state = build_state(parse_size(args.size), args.tensors)
    logical = sum(t.numel() * t.element_size() for t in state.values())
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "ab.gdsckpt"
    # the GPU engine's ANS, as on a fast tier (on a slow disk auto may pick the portable CPU engine)
    report = gdsckpt.save(state, path, config=gdsckpt.Config(engine="gpu"))
    path.read_bytes()  # in the page cache
    original = reading.restore_arrays

    def eager(*a, **k):  # type: ignore[no-untyped-def]
        k["new_targets"] = False
        return original(*a, **k)

    times: dict[str, list[float]] = {"deferred": [], "eager": []}
    for round_number in range(args.rounds):
        for way in times:
            reading.restore_arrays = eager if way == "eager" else original
            torch.cuda.synchronize()
            started = time.perf_counter()
            got = gdsckpt.load(path, device="cuda")
            torch.cuda.synchronize()
            times[way].append(time.perf_counter() - started)
            if round_number == 0:
                for key, tensor in state.items():
                    assert torch.equal(got[key].view(torch.uint8), tensor.view(torch.uint8)), key
            del got
    reading.restore_arrays = original
    print(f"{len(state)} tensors, {logical / 1e9:.2f} GB, ratio {report.ratio:.3f}, {args.rounds} rounds each")
    for way, values in times.items():
        median = statistics.median(values)
        print(f"  {way:9s} median {median * 1e3:7.1f} ms  {logical / median / 1e9:6.2f} GB/s"
              f"  ({', '.join(f'{v * 1e3:.1f}' for v in sorted(values))})")


if __name__ == "__main__":
    main()
