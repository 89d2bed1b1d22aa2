#!/usr/bin/env bash
# One GPU-host session: install the carried wheels, probe the stack, run the GPU test suite, and
# (with BENCH_SIZE set) the GPU benchmark. Logs and JSON land in $OUT (or ./gpu-out).
# Usage on the GPU host (repo root, .whl carried):  bash benchmarks/gpu_run.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/host.txt"
timeout 120 python3 benchmarks/gpu_probe.py > "$OUT/probe.json" 2> "$OUT/probe.err"; echo "probe rc=$?"
tail -c 3000 "$OUT/probe.json"; tail -5 "$OUT/probe.err"
timeout 420 python3 -m pytest -m gpu tests/gpu -x -q -p no:cacheprovider -o addopts="--strict-markers" \
  --timeout 120 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
if [ -n "${BENCH_SIZE:-}" ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/gpu_bench.py --size "$BENCH_SIZE" --dir /root/gdsckpt-bench \
    --out "$OUT/gpu-bench.json" 2>&1 | tee "$OUT/gpu-bench.log" | tail -30
fi
