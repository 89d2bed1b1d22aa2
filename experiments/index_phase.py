"""Where opening a large checkpoint spends its time: the index of the tier benchmark's state
(TinyGPT at about ``--size`` with bf16 weights, fp32 master weights and two AdamW moments: 596
tensors at 8 GiB) read and validated on this host's CPU, each step timed alone; plus the same
index decoded by orjson and msgspec where they are installed (each a candidate replacement for
the standard library's JSON decoder).

The state is zeros of the right shapes, saved once with ``codec="none"`` on the CPU engine into
``--dir`` (a file as large as the state: 8.9 GB at 8 GiB); its chunk count (4 MiB chunks) is
about four times a GPU save's (16 MiB chunks), so the chunk records weigh more here than there.

    python3 experiments/index_phase.py --size 8GiB --dir /tmp/index-phase
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import benchlib  # noqa: E402


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="8GiB")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--repeat", type=int, default=40)
    args = parser.parse_args()

    import torch

    import gdsckpt
    from gdsckpt.api.resolve import open_checked
    from gdsckpt.demo import TinyGPT
    from gdsckpt.format import checksum
    from gdsckpt.format import index as index_module
    from gdsckpt.io import PosixReader
    from gdsckpt.pipeline import load

    width, depth = benchlib.shape_for_bytes(benchlib.parse_size(args.size))
    path = Path(args.dir) / f"zeros-{width}x{depth}.gdsckpt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with torch.device("meta"):
            model = TinyGPT(vocab=benchlib.VOCAB, width=width, depth=depth, heads=benchlib.heads_for(width),
                            context=benchlib.CONTEXT)
        named = list(model.named_parameters())
        state = {"model": {n: torch.zeros(p.shape, dtype=torch.bfloat16) for n, p in named},
                 "master": {n: torch.zeros(p.shape) for n, p in named},
                 "optimizer": {n: {k: torch.zeros(p.shape) for k in benchlib.MOMENTS} for n, p in named}}
        gdsckpt.save(state, path, codec="none")
        del state
    reader = PosixReader(path)
    trailer, data = load._trailer_and_index(reader)
    doc = index_module._DECODER.decode(data.decode("utf-8"))
    chains = index_module._parse_chains(doc["chains"])
    chunks = index_module._parse_chunks(doc["chunks"], len(chains), trailer.index_offset)
    tensors = index_module._parse_tensors(doc["tensors"], chunks)
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("trailer + index read + CRC-32C", lambda: load._trailer_and_index(reader)),
        ("CRC-32C of the index", lambda: checksum(data)),
        ("SHA-256 of the index", lambda: hashlib.sha256(data).hexdigest()),
        ("JSON decode (standard library)", lambda: index_module._DECODER.decode(data.decode("utf-8"))),
        ("chunk records", lambda: index_module._parse_chunks(doc["chunks"], len(chains), trailer.index_offset)),
        ("tensor records", lambda: index_module._parse_tensors(doc["tensors"], chunks)),
        ("tree", lambda: index_module.validate_tree(doc["tree"], len(tensors))),
        ("parse_index (all of the above parsing)", lambda: index_module.parse_index(
            data, index_offset=trailer.index_offset)),
        ("open_file", lambda: load.open_file(reader)),
        ("open_checked (+ keys against the tree)", lambda: open_checked(reader)),
    ]
    try:
        import orjson

        steps.append(("JSON decode (orjson)", lambda: orjson.loads(data)))
    except ImportError:
        pass
    try:
        import msgspec

        decoder = msgspec.json.Decoder()
        steps.append(("JSON decode (msgspec, untyped)", lambda: decoder.decode(data)))
    except ImportError:
        pass
    print(f"{path.name}: {len(tensors)} tensors, {len(chunks)} chunks, index {len(data):,} bytes; "
          f"medians of {args.repeat}")
    for name, fn in steps:
        print(f"  {name:42s} {median_ms(fn, args.repeat):7.3f} ms")
    reader.close()


if __name__ == "__main__":
    main()
