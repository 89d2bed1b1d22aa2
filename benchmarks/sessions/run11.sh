#!/usr/bin/env bash
# Run 11 (session 4): the pending GPU measurements of issues 6 and 7.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export PYTHONUNBUFFERED=1
git rev-parse HEAD > "$OUT/host.txt" 2>/dev/null; date -u >> "$OUT/host.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$OUT/host.txt"
t0=$(date +%s)
timeout 150 python3 -m pytest tests/gpu/test_gpu_lossy.py tests/gpu/test_gpu_delta.py -q -p no:cacheprovider \
  -o addopts="--strict-markers" --timeout 100 > "$OUT/gpu-tests.log" 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"
tail -8 "$OUT/gpu-tests.log"
t0=$(date +%s)
timeout 230 python3 benchmarks/delta_bench.py --width 1024 --depth 4 --count-1000 3 --dir /root/gdsckpt-delta-bench \
  --out "$OUT/delta-bench.json" > "$OUT/delta-bench.log" 2>&1; echo "delta rc=$? $(( $(date +%s)-t0 ))s"
tail -25 "$OUT/delta-bench.log"
rm -rf /root/gdsckpt-delta-bench
mkdir -p /root/gdsckpt-bench-disk /dev/shm/gdsckpt-bench-shm
t0=$(date +%s)
timeout 130 python3 -m gdsckpt bench --target /root/gdsckpt-bench-disk --target /dev/shm/gdsckpt-bench-shm \
  --size 256MiB --codecs auto,ans,zstd,lz4 --chunk-sizes 16MiB --threads 16 --repeats 2 --baselines torch,safetensors \
  --device cuda --max-seconds 100 --out "$OUT/bench" --recommend > "$OUT/bench.log" 2>&1; echo "bench rc=$? $(( $(date +%s)-t0 ))s"
tail -30 "$OUT/bench.log"
