"""What nvCOMP Bitcomp's lossy mode (nvCOMP 6.0 Python) does with the values gdsckpt's lossy
contract names: NaN payloads, +-inf, -0.0, subnormals; whether a stream decodes with a codec
built without ``mode``/``delta``; whether values already on gdsckpt's grid (``grid_quantize``)
come back bit-exact with ``delta = step``; FP16. Prints one line per question."""



import cupy as cp
import numpy as np
import torch
from nvidia import nvcomp

from gdsckpt.lossy import grid_quantize

LOSSY = nvcomp.BitcompMode.BITCOMP_LOSSY_FP_TO_SIGNED
RAW = nvcomp.BitstreamKind.RAW


def roundtrip(data, delta, dtype, decoder=None):
    codec = nvcomp.Codec(algorithm="Bitcomp", mode=LOSSY, delta=delta, data_type=dtype, bitstream_kind=RAW)
    encoded = codec.encode(nvcomp.as_array(data))
    decoder = decoder or codec
    back = cp.asarray(decoder.decode(encoded)).view(cp.uint8)[: data.nbytes].view(data.dtype)
    return back, cp.asarray(encoded).nbytes


g = np.random.default_rng(1)
host = (g.standard_normal(1 << 20) * 0.02).astype(np.float32)
bits = host.view(np.uint32)
bits[0] = 0x7FC01234  # NaN with a payload
bits[1] = 0xFFA00001  # negative signalling-ish NaN
host[2], host[3], host[4] = np.inf, -np.inf, -0.0
host[5] = -1e-9  # rounds to zero
bits[6] = 0x00000123  # subnormal
host[7] = 1e30  # overflows the quantizer at this delta
data = cp.asarray(host)
delta = 2e-3
back, size = roundtrip(data, delta, "<f4")
b = cp.asnumpy(back)
print("ratio", host.nbytes / size)
print("NaN payload kept:", hex(b.view(np.uint32)[0]), hex(b.view(np.uint32)[1]))
print("+inf, -inf:", b[2], b[3], " -0.0 sign bit:", hex(b.view(np.uint32)[4]), " -1e-9 ->", b[5], hex(b.view(np.uint32)[5]))
print("subnormal:", hex(b.view(np.uint32)[6]), " 1e30 ->", b[7])
finite = np.isfinite(host) & (np.abs(host) < 1e29)
print("max finite error / (delta/2 rounded down to 2^k):", float(np.max(np.abs(b[finite].astype(np.float64) - host[finite]))) / (2.0 ** np.floor(np.log2(delta)) / 2))
for label, decoder in [("plain Bitcomp RAW <f4", nvcomp.Codec(algorithm="Bitcomp", data_type="<f4", bitstream_kind=RAW)),
                       ("plain Bitcomp RAW", nvcomp.Codec(algorithm="Bitcomp", bitstream_kind=RAW))]:
    try:
        other, _ = roundtrip(data, delta, "<f4", decoder)
        print(f"decode with {label}: identical bits {bool(cp.all(other.view(cp.uint32) == back.view(cp.uint32)))}")
    except Exception as err:
        print(f"decode with {label}: {type(err).__name__}: {str(err)[:200]}")
clean = (g.standard_normal(1 << 20) * 0.02).astype(np.float32)
grid = grid_quantize(torch.from_numpy(clean).cuda(), 1e-2)
on_grid = cp.asarray(grid.values)
again, size = roundtrip(on_grid, grid.step, "<f4")
diff = cp.asnumpy(again.view(cp.uint32) != on_grid.view(cp.uint32))
signs = cp.asnumpy(on_grid)[diff]
print(f"grid values re-encoded with delta=step: {int(diff.sum())} of {diff.size} differ; of those, zeros: "
      f"{int(np.sum(signs == 0))}; ratio {clean.nbytes / size:.3f}")
direct, size2 = roundtrip(cp.asarray(clean), grid.step, "<f4")
same = cp.asnumpy(direct.view(cp.uint32) == on_grid.view(cp.uint32))
d = cp.asnumpy(direct)
print(f"original values, delta=step: equal to the grid's bits {int(same.sum())} of {same.size}; equal as values "
      f"{int(np.sum(d == cp.asnumpy(on_grid)))}; ratio {clean.nbytes / size2:.3f}")
half = cp.asarray(clean.astype(np.float16))
h, hs = roundtrip(half, 2e-3, "<f2")
print(f"fp16: ratio {half.nbytes / hs:.3f}, max error {float(cp.abs(h.astype(cp.float32) - half.astype(cp.float32)).max()):.3g}")
