"""How much device memory nvCOMP's Python codecs hold beyond our buffers (scratch), per codec and
batch size, and whether routing nvCOMP's allocations through ``set_device_allocator`` can be
undone before interpreter exit (it crashed at exit when left installed). Writes JSON to stdout.

Usage on the GPU host:  python3 experiments/nvcomp_scratch_probe.py > scratch.json
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


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--codec":
        print(json.dumps(scratch(sys.argv[2])))
    else:
        main()
