#!/usr/bin/env bash
# Run 14 (session 5). (1) Issue 4, both parts of async_bench in one run: blocked time and training
# throughput of the defaults against configs/async-training.toml (worker process + CPU engine +
# GPU snapshot, which run 13 measured at 0.973), DCP async_save and torch.save as references.
# (2) The GPU tests of the worker with async_engine="cpu". (3) Issue 7: the lossy part of
# delta_bench with Zstd at 1e-2, whose JSON run 12b lost to its timeout.
# Output packed into one archive (the device tool returns at most 8 files).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT/r"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export PYTHONUNBUFFERED=1
R=$OUT/r
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; } > "$R/host.txt"
t0=$(date +%s)
timeout 350 python3 benchmarks/async_bench.py --width 2560 --depth 8 --rounds 3 --train-steps 400 --every 100 \
  --timeout 60 --workers thread --variant preset:@configs/async-training.toml \
  --skip dcp_async_save_pinned,train_gdsckpt_manager_gpu_snapshot,train_dcp_async_save \
  --dir /root/ab --out "$R/async-bench.json" > "$R/async-bench.log" 2>&1
echo "async rc=$? $(( $(date +%s)-t0 ))s"; sed -n '/^state /,$p' "$R/async-bench.log" | head -30
t0=$(date +%s)
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu_async_worker.py \
  > "$R/gpu-tests.log" 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -3 "$R/gpu-tests.log"
t0=$(date +%s)
timeout 150 python3 benchmarks/delta_bench.py --width 1024 --depth 4 --skip deltas --codec zstd --lossy-bounds 1e-2 \
  --dir /root/gdsckpt-delta-bench --out "$R/delta-bench-lossy-zstd.json" > "$R/delta-bench-lossy-zstd.log" 2>&1
echo "lossy zstd rc=$? $(( $(date +%s)-t0 ))s"; tail -5 "$R/delta-bench-lossy-zstd.log"
tar -C "$OUT" -czf "$OUT/run14.tgz" r && rm -rf "$R"
