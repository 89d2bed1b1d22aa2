#!/usr/bin/env bash
# Run 13 (session 5). (1) Issue 4: does the training slowdown during a background save go away
# when the save does no CUDA work in the training process? Training part of async_bench only: the
# default (thread, GPU engine) as this run's reference, and the CPU engine compressing the pinned
# snapshot in a thread, in a worker process, and in a worker process reading a GPU snapshot.
# (2) Issue 6: the `gdsckpt bench` run whose JSON did not come back from run 11 (run13-bench.sh).
# (3) The GPU tests of the last session's changes (lossy ANS trial, worker process).
# Output packed into one archive (the device tool returns at most 8 files).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT/r"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export PYTHONUNBUFFERED=1
R=$OUT/r
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; } > "$R/host.txt"
t0=$(date +%s)
timeout 270 python3 benchmarks/async_bench.py --width 2560 --depth 8 --train-steps 300 --every 100 --timeout 60 \
  --workers thread --training-only --skip train_gdsckpt_manager_gpu_snapshot,train_dcp_async_save \
  --variant cpu_thread:engine=cpu --variant cpu_process:engine=cpu,async_worker=process \
  --variant cpu_process_gpu_snapshot:engine=cpu,async_worker=process,snapshot_gpu_bytes=32GiB \
  --dir /root/ab --out "$R/async-train.json" > "$R/async-train.log" 2>&1
echo "async rc=$? $(( $(date +%s)-t0 ))s"; grep -A8 "^training" "$R/async-train.log"
mkdir -p /root/gdsckpt-bench-disk /dev/shm/gdsckpt-bench-shm
t0=$(date +%s)
timeout 130 python3 -m gdsckpt bench --target /root/gdsckpt-bench-disk --target /dev/shm/gdsckpt-bench-shm \
  --size 256MiB --codecs auto,ans,zstd,lz4 --chunk-sizes 16MiB --threads 16 --repeats 2 --baselines torch,safetensors \
  --device cuda --max-seconds 100 --out "$R/bench" --recommend > "$R/bench.log" 2>&1; echo "bench rc=$? $(( $(date +%s)-t0 ))s"
tail -22 "$R/bench.log"
t0=$(date +%s)
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu_lossy.py tests/gpu/test_gpu_async_worker.py \
  > "$R/gpu-tests.log" 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -3 "$R/gpu-tests.log"
tar -C "$OUT" -czf "$OUT/run13.tgz" r && rm -rf "$R"
