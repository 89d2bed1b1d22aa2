#!/usr/bin/env bash
# Run 12b (session 4): the lossy part of the delta benchmark with Zstd; the async benchmark of issue 4 with the save in a worker process.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT/r"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export PYTHONUNBUFFERED=1
R=$OUT/r
{ git rev-parse HEAD 2>/dev/null; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } > "$R/host.txt"
[ -n "${SKIP_LOSSY:-}" ] || {
t0=$(date +%s)
timeout 100 python3 benchmarks/delta_bench.py --width 1024 --depth 4 --skip deltas --codec zstd --dir /root/gdsckpt-delta-bench \
  --out "$R/delta-bench-lossy-zstd.json" > "$R/delta-bench-lossy-zstd.log" 2>&1; echo "lossy zstd rc=$? $(( $(date +%s)-t0 ))s"
tail -4 "$R/delta-bench-lossy-zstd.log"; rm -rf /root/gdsckpt-delta-bench; }
t0=$(date +%s)
# Before the timeout: every thread's stack of the benchmark and of its worker processes.
( sleep $(( ${ASYNC_TIMEOUT:-420} - 15 )); pkill -USR1 -f "from gdsckpt.worker import"; pkill -USR1 -f "^python3 benchmarks/async_bench.py" ) &
watchdog=$!
timeout ${ASYNC_TIMEOUT:-420} python3 benchmarks/async_bench.py --width 2560 --depth 8 --rounds 2 --train-steps 200 --every 100 ${ASYNC_ARGS:-} \
  --timeout 120 --skip "${ASYNC_SKIP:-dcp_async_save_pinned,train_gdsckpt_manager_gpu_snapshot}" \
  --dir /root/gdsckpt-async-bench --out "$R/async-bench.json" > "$R/async-bench.log" 2>&1; echo "async rc=$? $(( $(date +%s)-t0 ))s"
kill $watchdog 2>/dev/null; pkill -P $watchdog 2>/dev/null
tail -32 "$R/async-bench.log"
tar -C "$OUT" -czf "$OUT/run12b.tgz" r && rm -rf "$R"
