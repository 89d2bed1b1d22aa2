#!/usr/bin/env bash
# One GPU-host session: install the carried wheels, probe the stack, run the GPU test suite, and
# (with BENCH_WIDTH set) the save/load benchmark on the GPU. Logs and JSON land in $OUT (or ./gpu-out).
# Usage on the GPU host (repo root, .whl carried):  bash benchmarks/gpu_run.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/host.txt"
timeout 180 python3 benchmarks/gpu_probe.py > "$OUT/probe.json" 2> "$OUT/probe.err"; echo "probe rc=$?"
tail -c 3000 "$OUT/probe.json"; tail -5 "$OUT/probe.err"
# The whole GPU suite in one process, then (only if that process crashed) each test in its own
# process, so one native crash cannot hide the other results.
timeout 420 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -o addopts="--strict-markers -ra" \
  --timeout 120 > "$OUT/gpu-tests.log" 2>&1; rc=$?
tail -25 "$OUT/gpu-tests.log"
if [ $rc -gt 1 ]; then
  for id in $(python3 -m pytest -m gpu tests/gpu -q --collect-only -p no:cacheprovider -o addopts= 2>/dev/null | grep '::'); do
    timeout 120 python3 -m pytest "$id" -q -p no:cacheprovider -o addopts="--strict-markers" > /tmp/one.log 2>&1
    echo "rc=$? $id" | tee -a "$OUT/gpu-tests-isolated.log"; grep -E "Error|error|assert" /tmp/one.log | head -3
  done
fi
if [ -n "${BENCH_WIDTH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/save_load_bench.py --device cuda --width "$BENCH_WIDTH" --depth "${BENCH_DEPTH:-8}" \
    --dir /root/gdsckpt-bench --out "$OUT/gpu-bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/gpu-bench.log" | tail -30
fi
