"""Facts about the GPU host's stack (CuPy, nvCOMP, kvikio, the GPU) that the GPU engine relies on,
as JSON on stdout; ``benchmarks/gpu_run.sh`` runs it before the GPU suite. Without CuPy, nvCOMP
or CUDA it prints ``{"skipped": why}`` and exits 0.

    python3 benchmarks/gpu_probe.py > probe.json
"""

from __future__ import annotations

import json
import platform
import sys
import time

try:
    import cupy
    import torch
    from nvidia import nvcomp

    if not torch.cuda.is_available():
        raise ImportError("torch.cuda.is_available() is False")
except ImportError as err:
    print(json.dumps({"skipped": f"needs CUDA, CuPy and nvCOMP: {err}"}))
    sys.exit(0)

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
