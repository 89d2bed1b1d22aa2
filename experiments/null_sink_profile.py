"""The GPU save pipeline alone (``gdsckpt.save`` into ``gdsckpt.io.NullWriter``): its time against
the GPU's busy time, and where the encoder's worker thread spends the rest.

Builds the tier benchmark's state (``benchlib.sized_state``), saves it once to warm up, then
``--rounds`` times, timed, and prints the median. Then one more save under ``torch.profiler``
(CUDA activity only): the union of every kernel's and copy's interval on the device, which is the
GPU's busy time, and the kernels that took it. With ``--cprofile``, one more save with
``benchmarks/tier_bench.py``'s ``stage_timer``: a cProfile of the encoder's batches.

An A/B of two trees runs this once per tree in alternating processes, each with its tree first on
``PYTHONPATH`` (the first line printed names the gdsckpt imported):

    python3 experiments/null_sink_profile.py --size 8GiB --rounds 7 --cprofile
    PYTHONPATH=/path/to/old/tree python3 experiments/null_sink_profile.py --label old
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import benchlib
import torch

import gdsckpt
from gdsckpt.io import NullWriter


def timed(action) -> float:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    started = time.perf_counter()
    action()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals`` (start, end)."""
    total, start, end = 0.0, None, None
    for first, last in sorted(intervals):
        if start is None or end is None or first > end:
            if start is not None and end is not None:
                total += end - start
            start, end = first, last
        else:
            end = max(end, last)
    return total + (end - start if start is not None and end is not None else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="8GiB")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()

    report: dict = {}
    state, logical = benchlib.sized_state(report, args.size, args.steps, "cuda")
    print(f"{args.label}: {gdsckpt.__file__}, {logical / 1e9:.2f} GB state, {report['state']['tensors']} tensors")

    def save() -> None:
        gdsckpt.save(state, NullWriter())

    timed(save)
    seconds = [timed(save) for _ in range(args.rounds)]
    median = statistics.median(seconds)
    print(f"{args.label}: median {median * 1e3:.1f} ms = {logical / median / 1e9:.2f} GB/s, "
          f"rounds {[round(s * 1e3, 1) for s in seconds]}")

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        wall = timed(save)
    events = [e for e in profiled.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = busy_seconds([(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in events])
    print(f"{args.label}: profiled save {wall * 1e3:.1f} ms, GPU busy {busy * 1e3:.1f} ms")
    kernels: dict[str, list[float]] = {}
    for event in events:
        entry = kernels.setdefault(event.name[:60], [0, 0.0])
        entry[0] += 1
        entry[1] += (event.time_range.end - event.time_range.start) / 1e3
    for name, (count, ms) in sorted(kernels.items(), key=lambda item: -item[1][1])[:6]:
        print(f"   {ms:8.1f} ms {count:6d}  {name}")

    if args.cprofile:
        import tier_bench

        with tier_bench.stage_timer("cuda", True) as stages:
            timed(save)
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in stages.items() if not k.endswith("profile")})
        print(stages.get("encode_worker_profile", ""))


if __name__ == "__main__":
    main()
