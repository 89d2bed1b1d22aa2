"""Facts about the GPU host's nvCOMP / kvikio / CuPy that the GPU engine relies on (prints a report).

Run on the GPU host: python3 benchmarks/gpu_probe.py
"""

from __future__ import annotations

import json
import platform
import time

import cupy
import torch
from nvidia import nvcomp

facts: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
               "torch": torch.__version__, "cupy": cupy.__version__, "nvcomp": nvcomp.__version__,
               "gpu": torch.cuda.get_device_name(0)}
try:
    import kvikio
    import kvikio.defaults

    facts["kvikio"] = kvikio.__version__
    facts["kvikio_compat_mode_preferred"] = bool(kvikio.defaults.is_compat_mode_preferred())
except Exception as err:  # report, do not stop the probe
    facts["kvikio_error"] = repr(err)
facts["batcharray_attrs"] = [a for a in dir(nvcomp.BatchArray) if not a.startswith("_")]
facts["nvcomp_names"] = [a for a in dir(nvcomp) if not a.startswith("_")]

stream = cupy.cuda.Stream(non_blocking=True)
values = (torch.randn(64 << 20, device="cuda") * 0.02)
bf16 = cupy.asarray(values.to(torch.bfloat16).view(torch.uint8))
fp32 = cupy.asarray(values.view(torch.uint8))
ratios = {}
for label, data, width in (("bf16", bf16, 2), ("fp32", fp32, 4)):
    for chunk in (1 << 20, 4 << 20):
        pieces = [data[i:i + chunk] for i in range(0, data.nbytes, chunk)]
        planes = []
        for p in pieces:
            q = cupy.empty_like(p)
            q.reshape(width, -1)[...] = p.reshape(-1, width)[:, ::-1].T
            planes.append(q)
        for dtype in ("|u1", "<f2" if width == 2 else "<f4"):
            try:
                codec = nvcomp.Codec(algorithm="ANS", bitstream_kind=nvcomp.BitstreamKind.RAW, data_type=dtype,
                                     cuda_stream=stream.ptr)
                out = codec.encode(nvcomp.as_arrays(pieces, cuda_stream=stream.ptr))
                stored = sum(int(s) for s in out.buffer_sizes)
                ratios[f"{label} ans {dtype} chunk={chunk >> 10}KiB"] = round(data.nbytes / stored, 4)
            except Exception as err:
                ratios[f"{label} ans {dtype} chunk={chunk >> 10}KiB"] = f"error: {err}"
        codec = nvcomp.Codec(algorithm="ANS", bitstream_kind=nvcomp.BitstreamKind.RAW, cuda_stream=stream.ptr)
        out = codec.encode(nvcomp.as_arrays(planes, cuda_stream=stream.ptr))
        ratios[f"{label} planes+ans chunk={chunk >> 10}KiB"] = round(
            data.nbytes / sum(int(s) for s in out.buffer_sizes), 4)
facts["ans_ratios_normal_0.02"] = ratios
print(json.dumps(facts, indent=1))

# Carving outputs into memory we own (what the GPU engine does), per algorithm.
import sys  # noqa: E402

sys.path.insert(0, ".")
from gdsckpt.codecs.nvcomp import DeviceCodec  # noqa: E402

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
