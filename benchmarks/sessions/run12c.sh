#!/usr/bin/env bash
# Run 12c (session 4): where the training slowdown during a background save comes from. Training
# part of async_bench only: the save in a thread, in a niced worker process, and (a second run)
# with 4 kvikio threads instead of 16.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT/r"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export PYTHONUNBUFFERED=1
R=$OUT/r
{ git rev-parse HEAD 2>/dev/null; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } > "$R/host.txt"
SKIP=gdsckpt_save_async,gdsckpt_save_async_gpu_snapshot,gdsckpt_save_async_process,gdsckpt_save_async_process_gpu_snapshot,dcp_async_save,dcp_async_save_pinned,torch_save,train_gdsckpt_manager_gpu_snapshot,train_gdsckpt_manager_process_gpu_snapshot,train_dcp_async_save
t0=$(date +%s)
timeout 150 python3 benchmarks/async_bench.py --width 2560 --depth 8 --train-steps 200 --every 100 --timeout 60 \
  --workers thread,process --skip $SKIP --dir /root/ab --out "$R/async-train-16.json" > "$R/async-train-16.log" 2>&1
echo "16 threads rc=$? $(( $(date +%s)-t0 ))s"; grep -A6 "^training" "$R/async-train-16.log"
t0=$(date +%s)
GDSCKPT_KVIKIO_THREADS=4 timeout 110 python3 benchmarks/async_bench.py --width 2560 --depth 8 --train-steps 200 --every 100 \
  --timeout 60 --workers thread --skip $SKIP --dir /root/ab --out "$R/async-train-4.json" > "$R/async-train-4.log" 2>&1
echo "4 threads rc=$? $(( $(date +%s)-t0 ))s"; grep -A5 "^training" "$R/async-train-4.log"
tar -C "$OUT" -czf "$OUT/run12c.tgz" r && rm -rf "$R"
