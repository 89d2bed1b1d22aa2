"""How much device memory nvCOMP's Python codecs hold beyond our buffers (scratch), per codec and
batch size, and whether routing nvCOMP's allocations through ``set_device_allocator`` can be
undone before interpreter exit (it crashed at exit when left installed). Writes JSON to stdout.

Usage on the GPU host:  python3 experiments/nvcomp_scratch_probe.py > scratch.json

``--chunk-scan CODEC`` instead: for batches of 64 and 256 MiB cut into chunks of 64 KiB to 16 MiB
(each case in a process of its own), the scratch nvCOMP holds beyond our buffers while compressing
and decompressing the batch, and each direction's speed (the best of three calls after a first),
one JSON line per case. Whether the scratch grows with the chunk size or with the batch's bytes
is what ``gdsckpt.pipeline.gpu.ENCODE_SCRATCH`` models:

    python3 experiments/nvcomp_scratch_probe.py --chunk-scan zstd > zstd-scan.jsonl
"""

from __future__ import annotations

import json
import subprocess
import sys

CHUNK = 16 << 20
BATCHES = (1, 2, 4, 8, 16)

_ALLOCATOR_CHILD = r"""
import sys, cupy
from nvidia import nvcomp
mode = sys.argv[1]
nvcomp.set_device_allocator(lambda nbytes, stream: cupy.cuda.alloc(nbytes))
stream = cupy.cuda.Stream(non_blocking=True)
codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, cuda_stream=stream.ptr)
data = cupy.random.standard_normal(1 << 22, dtype=cupy.float32).astype(cupy.float16).view(cupy.uint8)
out = codec.encode(nvcomp.as_array(data))
back = codec.decode(out)
stream.synchronize()
del out, back, codec
if mode in ("reset-none", "reset-none-gc"):
    nvcomp.set_device_allocator(None)
if mode == "reset-none-gc":
    import gc; gc.collect()
print("ok")
"""


def scratch(codec_name: str) -> dict:
    """Device memory nvCOMP holds beyond our buffers after encoding / decoding batches of
    ``k`` 16 MiB chunks through ``DeviceCodec`` (the engine's own path), cumulative over k."""
    import cupy

    from gdsckpt.codecs.nvcomp import DeviceCodec

    stream = cupy.cuda.Stream(non_blocking=True)
    count = max(BATCHES)
    data = (cupy.random.standard_normal(count * CHUNK // 2, dtype=cupy.float32) * 0.02).astype(cupy.float16)
    data = data.view(cupy.uint8)
    encoder = DeviceCodec(codec_name, stream=stream, device_id=0)
    slot = -(-encoder.max_compressed_bytes(data[:CHUNK]) // 4096) * 4096
    out = cupy.empty(count * slot, dtype=cupy.uint8)
    decoded = cupy.empty(count * CHUNK, dtype=cupy.uint8)
    cupy.cuda.Device().synchronize()
    result: dict = {"encode_mib": {}, "decode_mib": {}}
    free0 = cupy.cuda.runtime.memGetInfo()[0]
    sizes: list[int] = []
    for k in BATCHES:
        sizes = encoder.encode_into([data[i * CHUNK:(i + 1) * CHUNK] for i in range(k)], out,
                                    [i * slot for i in range(k)], slot)
        stream.synchronize()
        result["encode_mib"][k] = round((free0 - cupy.cuda.runtime.memGetInfo()[0]) / 2**20, 1)
    decoder = DeviceCodec(codec_name, stream=stream, device_id=0)
    free1 = cupy.cuda.runtime.memGetInfo()[0]
    for k in BATCHES:
        decoder.decode_into([out[i * slot:i * slot + sizes[i]] for i in range(k)], decoded,
                            [i * CHUNK for i in range(k)], [CHUNK] * k)
        stream.synchronize()
        result["decode_mib"][k] = round((free1 - cupy.cuda.runtime.memGetInfo()[0]) / 2**20, 1)
    result["ratio"] = round(CHUNK * len(sizes) / sum(sizes), 3)
    del encoder, decoder
    return result


def main() -> None:
    from gdsckpt.codecs.base import gpu_codec_names

    report: dict = {"chunk_bytes": CHUNK, "codecs": {}, "allocator_reset": {}}
    for name in gpu_codec_names():  # one process per codec: a crash must not hide the others
        try:
            done = subprocess.run([sys.executable, __file__, "--codec", name], capture_output=True, text=True,
                                  timeout=60)
            report["codecs"][name] = (json.loads(done.stdout) if done.returncode == 0 else
                                      {"rc": done.returncode, "stderr": done.stderr[-400:]})
        except (subprocess.TimeoutExpired, ValueError) as err:
            report["codecs"][name] = {"error": f"{type(err).__name__}: {err}"}
    for mode in ("installed", "reset-none", "reset-none-gc"):
        try:
            done = subprocess.run([sys.executable, "-c", _ALLOCATOR_CHILD, mode], capture_output=True,
                                  text=True, timeout=60)
            report["allocator_reset"][mode] = {"rc": done.returncode, "stdout": done.stdout[-200:],
                                               "stderr": done.stderr[-400:]}
        except subprocess.TimeoutExpired:
            report["allocator_reset"][mode] = {"rc": "timeout"}
    print(json.dumps(report, indent=1))


def scan_case(codec_name: str, chunk: int, total: int) -> dict:
    """One case of ``--chunk-scan``: a batch of ``total`` bytes in chunks of ``chunk``."""
    import time

    import cupy

    from gdsckpt.codecs.nvcomp import DeviceCodec

    count = total // chunk
    stream = cupy.cuda.Stream(non_blocking=True)
    data = (cupy.random.standard_normal(total // 2, dtype=cupy.float32) * 0.02).astype(cupy.float16).view(cupy.uint8)
    views = [data[i * chunk:(i + 1) * chunk] for i in range(count)]

    def timed(call: object) -> float:
        times = []
        for _round in range(4):
            started = time.perf_counter()
            call()  # type: ignore[operator]
            stream.synchronize()
            times.append(time.perf_counter() - started)
        return total / min(times[1:]) / 1e9

    encoder = DeviceCodec(codec_name, stream=stream, device_id=0)
    slot = -(-encoder.max_compressed_bytes(data[:chunk]) // 4096) * 4096
    out = cupy.empty(count * slot, dtype=cupy.uint8)
    cupy.cuda.Device().synchronize()
    free = cupy.cuda.runtime.memGetInfo()[0]
    sizes: list[int] = []

    def encode(codec: DeviceCodec = encoder) -> None:
        sizes[:] = codec.encode_into(views, out, [i * slot for i in range(count)], slot)
    encode_gbps = timed(encode)
    encode_mib = (free - cupy.cuda.runtime.memGetInfo()[0]) / 2**20
    del encoder
    cupy.get_default_memory_pool().free_all_blocks()
    decoded = cupy.empty(total, dtype=cupy.uint8)
    cupy.cuda.Device().synchronize()
    free = cupy.cuda.runtime.memGetInfo()[0]
    decoder = DeviceCodec(codec_name, stream=stream, device_id=0)
    decode_gbps = timed(lambda: decoder.decode_into([out[i * slot:i * slot + sizes[i]] for i in range(count)],
                                                    decoded, [i * chunk for i in range(count)], [chunk] * count))
    decode_mib = (free - cupy.cuda.runtime.memGetInfo()[0]) / 2**20
    return {"codec": codec_name, "batch_mib": total >> 20, "chunk_kib": chunk >> 10, "chunks": count,
            "encode_scratch_mib": round(encode_mib, 1), "encode_gbps": round(encode_gbps, 3),
            "decode_scratch_mib": round(decode_mib, 1), "decode_gbps": round(decode_gbps, 3),
            "ratio": round(total / sum(sizes), 3), "bit_exact": bool((decoded == data).all())}


def chunk_scan(codec_name: str) -> None:
    """``--chunk-scan``: every case in a process of its own (nvCOMP keeps its scratch)."""
    for total in (64 << 20, 256 << 20):
        for chunk in (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20):
            try:
                done = subprocess.run([sys.executable, __file__, "--scan-case", codec_name, str(chunk), str(total)],
                                      capture_output=True, text=True, timeout=60)
                line = done.stdout.strip() if done.returncode == 0 else json.dumps(
                    {"chunk_kib": chunk >> 10, "batch_mib": total >> 20, "rc": done.returncode,
                     "stderr": done.stderr[-400:]})
            except subprocess.TimeoutExpired:
                line = json.dumps({"chunk_kib": chunk >> 10, "batch_mib": total >> 20, "timeout_s": 60})
            print(line, flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--codec":
        print(json.dumps(scratch(sys.argv[2])))
    elif len(sys.argv) == 3 and sys.argv[1] == "--chunk-scan":
        chunk_scan(sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "--scan-case":
        print(json.dumps(scan_case(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
    else:
        main()
