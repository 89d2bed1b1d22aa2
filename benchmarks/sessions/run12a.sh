#!/usr/bin/env bash
# Run 12a (session 4): GPU tests of the lossy ANS trial and the process worker; the lossy part of
# the delta benchmark; the 8.76 GiB pipeline benchmark without baselines (save memory, codec=auto).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT/r"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export PYTHONUNBUFFERED=1
R=$OUT/r
{ git rev-parse HEAD 2>/dev/null; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } > "$R/host.txt"
t0=$(date +%s)
timeout 170 python3 -m pytest tests/gpu/test_gpu_lossy.py tests/gpu/test_gpu_async_worker.py tests/gpu/test_gpu_delta.py -q \
  -p no:cacheprovider -o addopts="--strict-markers" --timeout 120 > "$R/gpu-tests.log" 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"
tail -15 "$R/gpu-tests.log"
t0=$(date +%s)
timeout 150 python3 benchmarks/delta_bench.py --width 1024 --depth 4 --skip deltas --dir /root/gdsckpt-delta-bench \
  --out "$R/delta-bench-lossy.json" > "$R/delta-bench-lossy.log" 2>&1; echo "lossy rc=$? $(( $(date +%s)-t0 ))s"
tail -12 "$R/delta-bench-lossy.log"; rm -rf /root/gdsckpt-delta-bench
t0=$(date +%s)
timeout 230 python3 benchmarks/gpu_bench.py --width 2560 --depth 8 --baselines none --dir /root/gdsckpt-bench \
  --out "$R/gpu-bench.json" > "$R/gpu-bench.log" 2>&1; echo "gpu_bench rc=$? $(( $(date +%s)-t0 ))s"
tail -25 "$R/gpu-bench.log"; rm -rf /root/gdsckpt-bench
tar -C "$OUT" -czf "$OUT/run12a.tgz" r && rm -rf "$R"
