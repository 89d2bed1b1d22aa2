#!/usr/bin/env bash
# Run 18 (session 6). Issue 7: the lossy part of delta_bench with the GPU default codec (ANS),
# whose grid-rounded moments the save now stores as Bitcomp lossy streams: ratios and the loss of
# training resumed from them after 100 steps, at 1e-2 and 1e-3.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT/r"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export PYTHONUNBUFFERED=1
R=$OUT/r
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; } > "$R/host.txt"
t0=$(date +%s)
timeout 330 python3 benchmarks/delta_bench.py --width 1024 --depth 4 --skip deltas --codec ans --lossy-bounds 1e-2,1e-3 \
  --dir /root/gdsckpt-delta-bench --out "$R/delta-bench-lossy-ans.json" > "$R/delta-bench-lossy-ans.log" 2>&1
echo "lossy ans rc=$? $(( $(date +%s)-t0 ))s"; tail -14 "$R/delta-bench-lossy-ans.log"
tar -C "$OUT" -czf "$OUT/run18.tgz" r && rm -rf "$R"
