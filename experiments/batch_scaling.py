"""How nvCOMP ANS (typed, as the GPU engine runs it) and the GPU CRC-32C scale with the number of
16 MiB chunks per batch, and with two batches on two streams at once: what decides the GPU
encoder's and decoder's batch size and worker count. Kernel time only (data already on the device).

    python3 experiments/batch_scaling.py > batch_scaling.json
    GDSCKPT_NVCOMP_ALLOCATOR=1 python3 experiments/batch_scaling.py > batch_scaling_pooled.json
    python3 experiments/batch_scaling.py --api c > batch_scaling_c.json

The second form gives nvCOMP its scratch from CuPy's pool: the per-call time at one chunk shows
what nvCOMP's own allocations cost (it did not change). The third runs ANS through nvCOMP's C API
(``nvcomp_c.AnsCodec``, what the GPU engine uses) instead of its Python API.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import cupy
import torch

from gdsckpt.codecs.nvcomp_c import crc32c_batch
from gdsckpt.codecs.nvcomp import DeviceCodec, install_nvcomp_allocator, nvcomp_allocator_installed
from gdsckpt.codecs.nvcomp_c import AnsCodec

CHUNK = 16 << 20


def pieces_of(data: cupy.ndarray, count: int, chunk: int = CHUNK) -> list[cupy.ndarray]:
    return [data[i * chunk:(i + 1) * chunk] for i in range(count)]


class Lane:
    """One stream, one codec, buffers for ``count`` chunks."""

    def __init__(self, data: cupy.ndarray, count: int, data_type: str, chunk: int = CHUNK, api: str = "python"):
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.codec = (AnsCodec(stream=self.stream, device_id=0, data_type=data_type) if api == "c"
                      else DeviceCodec("ans", stream=self.stream, device_id=0, data_type=data_type))
        self.pieces = pieces_of(data, count, chunk)
        self.slot = -(-self.codec.max_compressed_bytes(self.pieces[0]) // 4096) * 4096
        self.out = cupy.empty(count * self.slot, dtype=cupy.uint8)
        self.decoded = cupy.empty(count * chunk, dtype=cupy.uint8)
        self.count, self.chunk = count, chunk
        self.sizes: list[int] = []

    def encode(self) -> None:
        self.sizes = self.codec.encode_into(self.pieces, self.out, [i * self.slot for i in range(self.count)],
                                            self.slot)
        self.stream.synchronize()

    def streams(self) -> list[cupy.ndarray]:
        return [self.out[i * self.slot:i * self.slot + self.sizes[i]] for i in range(self.count)]

    def decode(self) -> None:
        self.codec.decode_into(self.streams(), self.decoded, [i * self.chunk for i in range(self.count)],
                               [self.chunk] * self.count)
        self.stream.synchronize()

    def crc(self) -> None:
        crc32c_batch(self.streams(), self.stream)


def best(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def together(fns) -> float:
    """Seconds for every fn to finish, each on its own thread, started together."""
    barrier = threading.Barrier(len(fns) + 1)

    def run(fn):
        cupy.cuda.Device(0).use()
        barrier.wait()
        fn()
    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--api", choices=("python", "c"), default="python", help="nvCOMP's API for ANS")
    api = parser.parse_args().api
    install_nvcomp_allocator()  # GDSCKPT_NVCOMP_ALLOCATOR=1: nvCOMP's scratch from CuPy's pool
    results: dict = {"gpu": torch.cuda.get_device_name(0), "chunk_bytes": CHUNK,
                     "nvcomp_allocator": nvcomp_allocator_installed(), "api": api}
    bf16 = cupy.asarray((torch.randn(2 << 30, device="cuda") * 0.02).to(torch.bfloat16).view(torch.uint8))
    for label, data, data_type in (("bf16_f2", bf16, "<f2"),):
        rows = {}
        for count in (1, 4, 16, 32, 64, 128, 256):
            lane = Lane(data, count, data_type, api=api)
            nbytes = count * CHUNK
            encode = best(lane.encode)
            decode = best(lane.decode)
            crc = best(lane.crc)
            rows[count] = {"encode_gbps": nbytes / encode / 1e9, "decode_gbps": nbytes / decode / 1e9,
                           "encode_ms": encode * 1e3, "decode_ms": decode * 1e3, "crc_ms": crc * 1e3,
                           "crc_gbps_of_stored": sum(lane.sizes) / crc / 1e9,
                           "ratio": nbytes / sum(lane.sizes)}
            print(label, count, rows[count], flush=True)
            del lane
        for count in (32, 64):
            lanes = [Lane(data[i * (count * CHUNK):], count, data_type, api=api) for i in range(2)]
            for lane in lanes:
                lane.encode()
            nbytes = 2 * count * CHUNK
            rows[f"2x{count}"] = {
                "encode_gbps": nbytes / min(together([lane.encode for lane in lanes]) for _ in range(3)) / 1e9,
                "decode_gbps": nbytes / min(together([lane.decode for lane in lanes]) for _ in range(3)) / 1e9,
                "crc_gbps_of_stored": sum(sum(lane.sizes) for lane in lanes)
                / min(together([lane.crc for lane in lanes]) for _ in range(3)) / 1e9}
            print(label, f"2x{count}", rows[f"2x{count}"], flush=True)
            del lanes
        small = Lane(data, 1024, data_type, chunk=1 << 20, api=api)
        rows["1024x1MiB"] = {"encode_gbps": (1 << 30) / best(small.encode) / 1e9,
                             "decode_gbps": (1 << 30) / best(small.decode) / 1e9,
                             "crc_gbps_of_stored": sum(small.sizes) / best(small.crc) / 1e9}
        print(label, "1024x1MiB", rows["1024x1MiB"], flush=True)
        results[label] = rows
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
