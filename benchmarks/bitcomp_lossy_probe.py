"""Does nvCOMP's Python API (this version) take Bitcomp's lossy mode? Prints what it finds."""
import cupy as cp
from nvidia import nvcomp
print("nvcomp", getattr(nvcomp, "__version__", "?"))
print("Codec doc:", (nvcomp.Codec.__init__.__doc__ or "")[:3000])
for name in dir(nvcomp):
    if "itcomp" in name.lower() or "lossy" in name.lower() or "mode" in name.lower():
        print("attr", name)
x = (cp.random.standard_normal(4 << 20, dtype=cp.float32) * 0.02)
arr = nvcomp.as_array(x)
def attempt(label, **kw):
    try:
        c = nvcomp.Codec(algorithm="Bitcomp", **kw)
        enc = c.encode(arr)
        size = cp.asarray(enc).nbytes
        dec = cp.asarray(c.decode(enc)).view(cp.uint8)[: x.nbytes].view(cp.float32)
        err = float(cp.abs(dec - x).max())
        print(f"OK {label}: ratio {x.nbytes / size:.3f} max err {err:.3g}")
    except Exception as e:
        print(f"FAIL {label}: {type(e).__name__}: {str(e)[:300]}")
attempt("lossless <f4", data_type="<f4")
for kw in [dict(mode=1, delta=1e-3), dict(mode="lossy", delta=1e-3), dict(lossy=True, delta=1e-3),
           dict(mode=1, delta=1e-3, data_type="<f4"), dict(bitcomp_mode=1, delta=1e-3, data_type="<f4"),
           dict(algorithm_type=0, mode=1, delta=1e-3, data_type="<f4")]:
    attempt(str(kw), **kw)

# Second round (after the first showed nvcomp.BitcompMode): the mode as that enum.
print("BitcompMode members:", [m for m in dir(nvcomp.BitcompMode) if m.startswith("BITCOMP")])
for delta in (2e-3, 2e-4, 2e-5):
    for mode in ("BITCOMP_LOSSY_FP_TO_SIGNED", "BITCOMP_LOSSY_FP_TO_UNSIGNED"):
        for bk in ("RAW", "NVCOMP_NATIVE"):
            attempt(f"{mode} delta={delta} {bk}", mode=getattr(nvcomp.BitcompMode, mode), delta=delta,
                    data_type="<f4", bitstream_kind=getattr(nvcomp.BitstreamKind, bk))
x16 = x.astype(cp.float16)
arr16 = nvcomp.as_array(x16)
try:
    c = nvcomp.Codec(algorithm="Bitcomp", mode=nvcomp.BitcompMode.BITCOMP_LOSSY_FP_TO_SIGNED, delta=2e-4, data_type="<f2")
    enc = c.encode(arr16)
    dec = cp.asarray(c.decode(enc)).view(cp.uint8)[: x16.nbytes].view(cp.float16)
    print(f"OK fp16 delta=2e-4: ratio {x16.nbytes / cp.asarray(enc).nbytes:.3f} max err "
          f"{float(cp.abs(dec.astype(cp.float32) - x16.astype(cp.float32)).max()):.3g}")
except Exception as e:
    print(f"FAIL fp16: {type(e).__name__}: {str(e)[:300]}")
