#!/usr/bin/env bash
# Why a decode replay's fill costs ~0.2 us a row inside vLLM and ~40 ns outside it
# (BENCHMARKS.md, "Where mmap still loses"): on an H200, without the engine,
#   1. benchmarks/bench_fill.py: the vLLM bench's tables (4 x 1 GiB, 16 shards, 256 B rows)
#      gathered at the engine's fill sizes, one table alone and four at once, on the shared
#      pool and inline (host only);
#   2. benchmarks/bench_worker.py twice, side by side in one call: its own 160 MiB table of
#      160 B rows, then one 1 GiB table of 256 B rows (the GPU's publish, the worker, the
#      pinned slot and the consumer as in the engine; READY -> FILLED and GPU waited).
# Run from the repository root with the wheel in /tmp/site (no vLLM needed); logs go to
# $OUT. Wall time about 3 minutes.
set -uo pipefail
OUT=${OUT:-/tmp/ple-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
R=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/fill_env.txt"
nproc | tee -a "$OUT/fill_env.txt"
timeout 200 python3 "$R/benchmarks/bench_fill.py" --tables 4 --table-gib 1 --shards 16 \
    --rows 16,128,1024,32768 2>&1 | tee "$OUT/fill_host.log" | tail -16
for args in "--table-rows 1048576 --width 160" "--table-rows 4194304 --width 256"; do
    tag=$(echo "$args" | tr -c 'a-z0-9' _)
    # shellcheck disable=SC2086  # the arguments split on purpose
    timeout 150 python3 "$R/benchmarks/bench_worker.py" --iters "${WORKER_ITERS:-500}" $args \
        --json "$OUT/fill_worker_$tag.json" 2>&1 | tee "$OUT/fill_worker_$tag.log" | tail -9
done
