"""How fast nvCOMP Bitcomp's lossy mode encodes and decodes 16 MiB fp32 chunks on one GPU, one
chunk per call against a batch of them per call, with nvCOMP's own allocations and with CuPy's
pool as its allocator (``nvcomp.set_device_allocator``); Bitcomp lossless and ANS for reference.
Each figure is the median of 5 timed repeats after a warm-up, GB/s of raw bytes, stream
synchronized. Prints a table.

    python3 experiments/bitcomp_lossy_speed.py --chunks 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import cupy as cp
from nvidia import nvcomp

CHUNK = 16 << 20


def codec(kind: str, stream: cp.cuda.Stream) -> nvcomp.Codec:
    options = {"bitstream_kind": nvcomp.BitstreamKind.RAW, "cuda_stream": stream.ptr, "device_id": 0}
    if kind == "bitcomp-lossy":
        return nvcomp.Codec(algorithm="Bitcomp", mode=nvcomp.BitcompMode.BITCOMP_LOSSY_FP_TO_SIGNED, delta=2.0 ** -12,
                            data_type="<f4", **options)
    if kind == "bitcomp":
        return nvcomp.Codec(algorithm="Bitcomp", data_type="<f4", **options)
    return nvcomp.Codec(algorithm="ANS", data_type="<f4", **options)


def seconds(function, stream: cp.cuda.Stream) -> float:
    function()
    stream.synchronize()
    times = []
    for _ in range(5):
        started = time.perf_counter()
        function()
        stream.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(kind: str, chunks: list, stream: cp.cuda.Stream) -> dict[str, float]:
    c = codec(kind, stream)
    total = sum(x.nbytes for x in chunks)
    with stream:
        encoded = c.encode(nvcomp.as_arrays(chunks, cuda_stream=stream.ptr))
        singles = [c.encode(nvcomp.as_array(x, cuda_stream=stream.ptr)) for x in chunks]
        stream.synchronize()
        return {
            "encode_batch": total / seconds(lambda: c.encode(nvcomp.as_arrays(chunks, cuda_stream=stream.ptr)), stream),
            "encode_single": total / seconds(lambda: [c.encode(nvcomp.as_array(x, cuda_stream=stream.ptr))
                                                      for x in chunks], stream),
            "decode_batch": total / seconds(lambda: c.decode(encoded), stream),
            "decode_single": total / seconds(lambda: [c.decode(s) for s in singles], stream),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args()
    stream = cp.cuda.Stream(non_blocking=True)
    rng = cp.random.default_rng(0)
    chunks = [(rng.standard_normal(CHUNK // 4, dtype=cp.float32) * 1e-3) for _ in range(args.chunks)]
    chunks = [cp.round(x / 2.0 ** -12) * 2.0 ** -12 for x in chunks]  # on the grid of delta
    chunks = [x.astype(cp.float32).view(cp.uint8) for x in chunks]
    rows = []
    for allocator in ("nvcomp", "cupy-pool"):
        if allocator == "cupy-pool":
            nvcomp.set_device_allocator(lambda nbytes, s: cp.cuda.alloc(nbytes))
        for kind in ("bitcomp-lossy", "bitcomp", "ans"):
            rows.append((allocator, kind, measure(kind, chunks, stream)))
    nvcomp.set_device_allocator(None)
    print(f"{args.chunks} chunks of 16 MiB fp32, GB/s (median of 5)")
    print(f"  {'allocator':10}{'codec':15}{'enc batch':>11}{'enc single':>11}{'dec batch':>11}{'dec single':>11}")
    for allocator, kind, r in rows:
        print(f"  {allocator:10}{kind:15}{r['encode_batch'] / 1e9:>11.1f}{r['encode_single'] / 1e9:>11.1f}"
              f"{r['decode_batch'] / 1e9:>11.1f}{r['decode_single'] / 1e9:>11.1f}")


if __name__ == "__main__":
    main()
