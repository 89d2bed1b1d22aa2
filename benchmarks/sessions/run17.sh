#!/usr/bin/env bash
# Run 17 (session 6). Issue 7: Bitcomp's lossy mode in the save path (GPU engine, grid-rounded
# fp32/fp16 arrays under a GPU-only codec, each stream checked by decoding it again).
# (1) The new and changed lossy GPU tests, then the rest of the GPU suite (the encode path was
# split into _encode_bitcomp_lossy / _encode_codec). (2) bitcomp_lossy_compare.py: Bitcomp alone
# against save() with Zstd, ANS (now Bitcomp lossy) and ANS with bitcomp=False.
# Output packed into one archive (the device tool returns at most 8 files).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT/r"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export PYTHONUNBUFFERED=1
R=$OUT/r
{ date -u; git log -1 --format=%h 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; } > "$R/host.txt"
t0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_lossy.py > "$R/gpu-tests-lossy.log" 2>&1
echo "lossy tests rc=$? $(( $(date +%s)-t0 ))s"; tail -15 "$R/gpu-tests-lossy.log"
t0=$(date +%s)
timeout 100 python3 benchmarks/bitcomp_lossy_compare.py --out "$R/bitcomp-lossy-save.json" > "$R/bitcomp-lossy-save.log" 2>&1
echo "compare rc=$? $(( $(date +%s)-t0 ))s"; tail -12 "$R/bitcomp-lossy-save.log"
t0=$(date +%s)
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu --deselect tests/gpu/test_gpu_lossy.py \
  > "$R/gpu-tests.log" 2>&1
echo "gpu suite rc=$? $(( $(date +%s)-t0 ))s"; grep -E "FAILED|ERROR|passed|failed" "$R/gpu-tests.log" | tail -15
tar -C "$OUT" -czf "$OUT/run17.tgz" r && rm -rf "$R"
