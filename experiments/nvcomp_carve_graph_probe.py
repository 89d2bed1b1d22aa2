"""nvCOMP through gdsckpt's ``DeviceCodec``: carving each algorithm's output into memory we own
(what the GPU engine does), and whether the compress step can be captured in a CUDA graph.
Uses gdsckpt's internal ``gdsckpt.codecs.nvcomp.DeviceCodec`` (no public equivalent).

    python3 experiments/nvcomp_carve_graph_probe.py
"""

from __future__ import annotations

import json

import cupy
import torch

from gdsckpt.codecs.nvcomp import DeviceCodec

stream = cupy.cuda.Stream(non_blocking=True)
values = torch.randn(64 << 20, device="cuda") * 0.02
bf16 = cupy.asarray(values.to(torch.bfloat16).view(torch.uint8))

# Carving outputs into memory we own (what the GPU engine does), per algorithm.
carve: dict = {}
data = bf16[: 4 << 20]
for name in ("ans", "zstd", "lz4", "deflate", "gdeflate", "snappy", "bitcomp", "cascaded"):
    try:
        codec = DeviceCodec(name, stream=stream, device_id=0, data_type="<f2" if name == "ans" else None)
        bound = codec.max_compressed_bytes(data)
        out = cupy.zeros(2 * bound, dtype=cupy.uint8)
        sizes = codec.encode_into([data, data[: 1 << 20]], out, [0, bound], bound)
        back = cupy.zeros(5 << 20, dtype=cupy.uint8)
        got = codec.decode_into([out[:sizes[0]], out[bound:bound + sizes[1]]], back, [0, 4 << 20],
                                [4 << 20, 1 << 20])
        stream.synchronize()
        ok = bool((back[: 4 << 20] == data).all()) and bool((back[4 << 20:] == data[: 1 << 20]).all())
        carve[name] = {"bound": bound, "sizes": sizes, "decoded": got, "exact": ok}
    except Exception as err:
        carve[name] = f"error: {type(err).__name__}: {err}"
print(json.dumps({"carve": carve}, indent=1))

# Can the fixed-shape compress step be captured in a CUDA graph?
graph_report: dict = {}
try:
    codec = DeviceCodec("ans", stream=stream, device_id=0, data_type="<f2")
    data = bf16[: 4 << 20]
    bound = codec.max_compressed_bytes(data)
    out = cupy.zeros(bound, dtype=cupy.uint8)
    codec.encode_into([data], out, [0], bound)  # warm-up outside capture
    stream.synchronize()
    stream.begin_capture()
    try:
        codec.encode_into([data], out, [0], bound)
    finally:
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    graph_report["captured"] = True
except Exception as err:
    graph_report["captured"] = False
    graph_report["error"] = f"{type(err).__name__}: {err}"
print(json.dumps({"cuda_graph": graph_report}))
