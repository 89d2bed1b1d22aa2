"""Cold restores into CUDA tensors with the kvikio reader's cold-read task size against kvikio's
default task size, each next to cold raw reads of the same file at both task sizes. GPU host.

The state (``benchlib.build_state``, about ``--size``) is saved once as nvCOMP ANS and once as a
portable file (``portable=True``). Then, for ``--rounds`` rounds, for each file, the ways below in
turn (reversed every other round), each from a cold file (``benchlib.make_cold``):

- ``raw 4MiB`` / ``raw 16MiB``: one kvikio read of the whole file into one device buffer, 16 threads,
  tasks of kvikio's default (4 MiB) / of 16 MiB;
- ``restore cold-task``: ``gdsckpt.load(path, device="cuda")`` as the library runs it (a file not in
  the page cache read in ``io.kvikio.COLD_READ_TASK_BYTES`` tasks);
- ``restore default-task``: the same with ``COLD_READ_TASK_BYTES`` set to None (kvikio's task
  size for every read, as before).

After each round the ANS file is read once and restored again from the page cache, recording the
task size the reader chose there (None: kvikio's own). Every way's first restore is compared bit
for bit with the state.

    python3 experiments/cold_reads.py --size 8GiB --rounds 3 --dir /root/cold --out cold-reads.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import benchlib
from tier_bench import raw_device_read, stage_timer, timed

GB = 1e9
RAW_WAYS = {"raw 4MiB": None, "raw 16MiB": 16 << 20}


def run(report: benchlib.Report, directory: Path, args: argparse.Namespace) -> None:
    import gdsckpt
    from gdsckpt.io import kvikio as kvikio_io

    state, logical = benchlib.sized_state(report, args.size, args.steps, "cuda")
    drop = benchlib.can_drop_caches()
    report["state"]["drop_caches"] = drop
    results = report["results"]
    files = {"ans": directory / "ans.gdsckpt", "portable": directory / "portable.gdsckpt"}
    gdsckpt.save(state, files["ans"], codec="ans")
    gdsckpt.save(state, files["portable"], portable=True)
    report["state"]["file_bytes"] = {name: path.stat().st_size for name, path in files.items()}

    chosen: list[int | None] = []
    original_init = kvikio_io.KvikioReader.__init__

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        chosen.append(self.read_task_bytes)

    cold_task = kvikio_io.COLD_READ_TASK_BYTES
    restore_ways = {"restore cold-task": cold_task, "restore default-task": None}
    kvikio_io.KvikioReader.__init__ = recording_init  # type: ignore[method-assign]
    try:
        for round_number in range(args.rounds):
            for name, path in files.items():
                ways = ["raw 4MiB", "restore cold-task", "raw 16MiB", "restore default-task"]
                if round_number % 2:
                    ways.reverse()
                for way in ways:
                    benchlib.make_cold(path, drop_caches=drop)
                    profile: dict[str, float] = {}
                    if way in RAW_WAYS:
                        seconds = timed(raw_device_read(path, 16, RAW_WAYS[way]), "cuda")[0]
                        task = RAW_WAYS[way]
                    else:
                        kvikio_io.COLD_READ_TASK_BYTES = restore_ways[way]
                        try:
                            with stage_timer("cuda" if args.profile else "cpu") as stages:
                                seconds, loaded = timed(lambda path=path: gdsckpt.load(path, device="cuda"), "cuda")
                        finally:
                            kvikio_io.COLD_READ_TASK_BYTES = cold_task
                        profile = {key: value for key, value in stages.items() if isinstance(value, float)}
                        task = chosen[-1]
                        if round_number == 0:
                            report.check(f"{name}/{way}", benchlib.differences(state, loaded, tensors_only=True))
                        del loaded
                    results.setdefault(f"{name}/{way}", {"rounds": []})["rounds"].append(
                        {"seconds": seconds, "task_bytes": task, **({"profile": profile} if profile else {})})
                    report.write()
            files["ans"].read_bytes()
            seconds, loaded = timed(lambda: gdsckpt.load(files["ans"], device="cuda"), "cuda")
            del loaded
            results.setdefault("ans/restore warm", {"rounds": []})["rounds"].append(
                {"seconds": seconds, "task_bytes": chosen[-1]})
    finally:
        kvikio_io.KvikioReader.__init__ = original_init  # type: ignore[method-assign]
        kvikio_io.COLD_READ_TASK_BYTES = cold_task
    for label, entry in results.items():
        seconds = benchlib.median([r["seconds"] for r in entry["rounds"]])
        entry.update(seconds=seconds, gbps=logical / seconds / GB)
    for name in files:
        best_raw = min(results[f"{name}/{way}"]["seconds"] for way in RAW_WAYS)
        for way in restore_ways:
            report["limits"][f"{name}/{way}"] = best_raw / results[f"{name}/{way}"]["seconds"]
    report.write()
    for path in files.values():
        benchlib.remove(path)


def show(report: benchlib.Report) -> None:
    for label, entry in report["results"].items():
        rounds = " ".join(f"{r['seconds']:.3f}" for r in entry["rounds"])
        tasks = {r["task_bytes"] for r in entry["rounds"]}
        print(f"{label:28} {entry['gbps']:6.2f} GB/s logical, median {entry['seconds']:.3f} s  (rounds {rounds}; "
              f"task {', '.join(str(t) for t in sorted(tasks, key=str))})")
    for label, fraction in report["limits"].items():
        print(f"{label:28} {fraction:.3f} of ratio x the faster raw read")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="8GiB")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/gdsckpt-cold")
    parser.add_argument("--out", default="cold-reads.json")
    parser.add_argument("--profile", action="store_true", help="record each restore's timeline")
    args = parser.parse_args()
    args.device = "cuda"
    return benchlib.run_benchmark("cold_reads", args, lambda report, directory: run(report, directory, args), show)


if __name__ == "__main__":
    sys.exit(main())
