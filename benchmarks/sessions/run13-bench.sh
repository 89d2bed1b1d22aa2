#!/usr/bin/env bash
# For the next device session (issue 6): the `gdsckpt bench` run over the root disk and /dev/shm
# whose JSON did not come back from run 11 (the device tool returns at most 8 files: everything
# is packed into one archive here).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT/r"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export PYTHONUNBUFFERED=1
R=$OUT/r
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } > "$R/host.txt"
mkdir -p /root/gdsckpt-bench-disk /dev/shm/gdsckpt-bench-shm
t0=$(date +%s)
timeout 130 python3 -m gdsckpt bench --target /root/gdsckpt-bench-disk --target /dev/shm/gdsckpt-bench-shm \
  --size 256MiB --codecs auto,ans,zstd,lz4 --chunk-sizes 16MiB --threads 16 --repeats 2 --baselines torch,safetensors \
  --device cuda --max-seconds 100 --out "$R/bench" --recommend > "$R/bench.log" 2>&1; echo "bench rc=$? $(( $(date +%s)-t0 ))s"
tail -30 "$R/bench.log"
tar -C "$OUT" -czf "$OUT/run13-bench.tgz" r && rm -rf "$R"
