"""CPU restores that decode each chunk straight into the one destination taking it whole
(``Decoder.submit_decode``'s ``into``: the byte-plane inverse writes the tensor's memory) against
decoding into a new array and copying it into the destination, in one process, alternating.

The benchmarks' trained state (``benchlib.build_state``) is saved as a ``CheckpointManager`` with
a remote tier saves it (``codec="auto"`` compressing even where the local disk outruns it: byte
planes + zstd where that pays), then loaded ``--rounds`` times each way from the page cache;
the first load of each way is checked bit for bit. Prints the median wall and CPU seconds (this
process, all threads). Uses internals: it patches ``pipeline.load._whole_chunk_views`` to keep
only the chunks stored as they are (read straight into their destination as before) for the
copying side.

    python3 experiments/decode_into_ab.py --width 1024 --depth 6 --rounds 11 --dir /tmp/decode-into
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import benchlib  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()

    import gdsckpt
    from gdsckpt.api.saving import save_flat
    from gdsckpt.pipeline import load
    from gdsckpt.state import flatten

    state = benchlib.build_state(args.width, args.depth, 2, "cpu")
    logical = benchlib.logical_bytes(state)
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "decode-into.gdsckpt"
    report = save_flat(flatten(state), path, codec="auto", config=gdsckpt.Config(), may_store_as_is=False)
    path.read_bytes()  # in the page cache
    original = load._whole_chunk_views

    def as_is_only(index: Any, engine: Any, targets: Any, deliveries: Any) -> dict[int, Any]:
        views = original(index, engine, targets, deliveries)
        return {chunk: view for chunk, view in views.items() if load._stored_as_is(index, chunk)}

    ways = {"decode into": original, "copy after": as_is_only}
    measured: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
    for round_number in range(args.rounds):
        for way, views in ways.items():
            load._whole_chunk_views = views  # type: ignore[assignment]
            before, started = os.times(), time.perf_counter()
            got = gdsckpt.load(path)
            wall = time.perf_counter() - started
            after = os.times()
            measured[way].append((wall, after.user + after.system - before.user - before.system))
            if round_number == 0:
                problems = benchlib.differences(state, got)
                assert not problems, problems
            del got
    load._whole_chunk_views = original  # type: ignore[assignment]
    print(f"state {logical / 1e9:.3f} GB, file {report.file_bytes / 1e9:.3f} GB, ratio {report.ratio:.3f}, "
          f"chains {report.chains}; {args.rounds} rounds each, page cache, {os.cpu_count()} cores")
    for way, rows in measured.items():
        wall = statistics.median(row[0] for row in rows)
        cpu = statistics.median(row[1] for row in rows)
        print(f"  {way:12s} wall {wall:.3f} s ({logical / wall / 1e9:.2f} GB/s)  CPU {cpu:.3f} s  "
              f"(walls {', '.join(f'{row[0]:.3f}' for row in sorted(rows))})")


if __name__ == "__main__":
    main()
