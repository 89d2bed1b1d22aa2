"""What Python's cyclic garbage collector adds to opening a checkpoint in a process with many live
objects (a training process): the index of the tier benchmark's state (596 tensors) parsed with
the collector running and held off during the parse (``gc.disable()`` around it), with ``--heap``
million small live objects around it; each parse is followed by allocations like those of the
restore after it (``--after`` thousand small objects), timed with it, so that a collection the
pause only postpones shows up in the second column. The two ways run one after the other, not
alternating, so that neither pays for the other's collections.

The index comes from a real save of that state (``benchlib.build_state``, stored as it is with
16 MiB chunks like the GPU engine's, in ``--dir``; the file is deleted after its index is read).

    python3 experiments/index_parse_gc.py --dir /tmp --heap 2 --rounds 30 --after 50
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import benchlib  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--heap", type=float, default=2.0, help="million live objects around the parse")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--after", type=float, default=50.0, help="thousand objects allocated after each parse")
    args = parser.parse_args()

    import gdsckpt
    from gdsckpt.format import index as index_module
    from gdsckpt.io.posix import PosixReader
    from gdsckpt.pipeline.load import _trailer_and_index

    path = Path(args.dir) / "index-parse-gc.gdsckpt"
    state = benchlib.build_state(2048, 12, 1, "cpu")
    gdsckpt.save(state, path, codec="none", config=gdsckpt.Config(chunk_bytes=16 << 20))
    del state
    with PosixReader(path) as reader:
        trailer, index_bytes = _trailer_and_index(reader)
    path.unlink()
    parsed = index_module.parse_index(index_bytes, index_offset=trailer.index_offset)
    print(f"index: {len(index_bytes)} bytes, {len(parsed.tensors)} tensors, {len(parsed.chunks)} chunks")

    heap = [{"n": i} for i in range(int(args.heap * 1e6))]  # noqa: F841 - live objects the collector scans

    def parse() -> None:
        index_module.parse_index(index_bytes, index_offset=trailer.index_offset)

    def held_off() -> None:
        gc.disable()
        try:
            parse()
        finally:
            gc.enable()

    gc.enable()
    for label, way in (("collector running", parse), ("collector held off", held_off)):
        gc.collect()
        parses, with_after = [], []
        for _ in range(args.rounds):
            started = time.perf_counter()
            way()
            parsed_at = time.perf_counter()
            after = [[n] for n in range(int(args.after * 1000))]
            del after
            parses.append(parsed_at - started)
            with_after.append(time.perf_counter() - started)
        print(f"{label:20s} parse median {statistics.median(parses) * 1e3:6.2f} ms, max {max(parses) * 1e3:7.2f}; "
              f"with the allocations after it median {statistics.median(with_after) * 1e3:6.2f} ms, "
              f"max {max(with_after) * 1e3:7.2f} ({len(parses)} rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
