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


def codec_speeds(data: cupy.ndarray, chunk: int = 16 << 20, repeats: int = 3) -> dict:
    """Compress and decompress GB/s (best of ``repeats``, after one warm-up) and ratio of every
    nvCOMP codec through ``DeviceCodec``, the GPU engine's own path: one batch of ``chunk``-byte
    chunks, as the engine sends them. Raw bytes over kernel time; no planes, no ANS data type."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    from gdsckpt.codecs import gpu_codec_names
    from gdsckpt.codecs.nvcomp import DeviceCodec

    count = data.nbytes // chunk
    pieces = [data[i * chunk:(i + 1) * chunk] for i in range(count)]
    result: dict = {"chunk_bytes": chunk, "chunks": count, "data": "bf16 N(0, 0.02)"}
    for name in gpu_codec_names():
        codec = DeviceCodec(name, stream=stream, device_id=0)
        try:
            slot = -(-codec.max_compressed_bytes(pieces[0]) // 4096) * 4096
            out = cupy.empty(count * slot, dtype=cupy.uint8)
            decoded = cupy.empty(count * chunk, dtype=cupy.uint8)
            best_encode = best_decode = float("inf")
            for attempt in range(repeats + 1):
                stream.synchronize()
                started = time.perf_counter()
                sizes = codec.encode_into(pieces, out, [i * slot for i in range(count)], slot)
                stream.synchronize()
                middle = time.perf_counter()
                codec.decode_into([out[i * slot:i * slot + sizes[i]] for i in range(count)], decoded,
                                  [i * chunk for i in range(count)], [chunk] * count)
                stream.synchronize()
                if attempt:  # the first pass warms nvCOMP up
                    best_encode = min(best_encode, middle - started)
                    best_decode = min(best_decode, time.perf_counter() - middle)
            exact = bool((decoded == data[:count * chunk]).all())
            result[name] = {"compress_gbps": round(data.nbytes / best_encode / 1e9, 1),
                            "decompress_gbps": round(data.nbytes / best_decode / 1e9, 1),
                            "ratio": round(data.nbytes / sum(sizes), 4), "bit_exact": exact}
            del out, decoded
        except Exception as err:  # report, do not stop the probe
            result[name] = {"error": f"{type(err).__name__}: {err}"}
        finally:
            codec.close()
        cupy.get_default_memory_pool().free_all_blocks()
    return result


try:
    facts["codec_speeds"] = codec_speeds(cupy.asarray(
        (torch.randn(256 << 20, device="cuda") * 0.02).to(torch.bfloat16).view(torch.uint8)))
except Exception as err:  # report, do not stop the probe
    facts["codec_speeds"] = {"error": f"{type(err).__name__}: {err}"}
print(json.dumps(facts, indent=1))
