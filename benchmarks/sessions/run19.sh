#!/usr/bin/env bash
# Run 19 (session 6). Issue 7: the Bitcomp lossy check now decodes a group's device chunks in one
# call. (1) tests/gpu/test_gpu_lossy.py + the engine's save tests; (2) bitcomp_lossy_speed.py:
# one chunk per call against batches, nvCOMP's allocator against CuPy's pool; (3) the save
# profile and (4) the save comparison again, for the new save times.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT/r"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export PYTHONUNBUFFERED=1
R=$OUT/r
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; } > "$R/host.txt"
t0=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_lossy.py tests/gpu/test_gpu.py > "$R/gpu-tests.log" 2>&1
echo "tests rc=$? $(( $(date +%s)-t0 ))s"; grep -E "FAILED|ERROR|passed|failed" "$R/gpu-tests.log" | tail -8
t0=$(date +%s)
timeout 90 python3 benchmarks/bitcomp_lossy_speed.py --chunks 8 > "$R/bitcomp-lossy-speed.log" 2>&1
echo "speed rc=$? $(( $(date +%s)-t0 ))s"; tail -8 "$R/bitcomp-lossy-speed.log"
t0=$(date +%s)
timeout 90 python3 benchmarks/lossy_save_profile.py --rel 1e-2 --top 8 > "$R/lossy-save-profile.log" 2>&1
echo "profile rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^==|^   [A-Za-z]" "$R/lossy-save-profile.log"
t0=$(date +%s)
timeout 100 python3 benchmarks/bitcomp_lossy_compare.py --out "$R/bitcomp-lossy-save.json" > "$R/bitcomp-lossy-save.log" 2>&1
echo "compare rc=$? $(( $(date +%s)-t0 ))s"; tail -10 "$R/bitcomp-lossy-save.log"
tar -C "$OUT" -czf "$OUT/run19.tgz" r && rm -rf "$R"
