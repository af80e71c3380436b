#!/usr/bin/env bash
# The core's GPU tests and benchmarks on an H200. Run from the repository root with
# the wheel installed and PYTHONPATH set (see README, "GPU machine"); logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/ple-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
R=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/core_env.txt"
# PYTEST_IGNORE: test files to leave to their own scripts (space-separated, under tests/).
ignore=()
for f in ${PYTEST_IGNORE:-}; do ignore+=(--ignore "$R/tests/$f"); done
(cd /tmp && timeout 420 python3 -m pytest "$R/tests" -q -rs --timeout=120 -p no:cacheprovider \
    "${ignore[@]}" 2>&1) | tee "$OUT/core_pytest.log" | tail -25
if [ "${BENCH:-1}" = 1 ]; then
    timeout 240 python3 "$R/benchmarks/bench_worker.py" --iters "${WORKER_ITERS:-500}" \
        --json "$OUT/core_worker.json" 2>&1 | tee "$OUT/core_bench_worker.log" | tail -14
    timeout 400 python3 "$R/benchmarks/bench_step.py" --steps "${STEP_STEPS:-150}" \
        --rounds "${STEP_ROUNDS:-3}" --json "$OUT/core_step.json" 2>&1 \
        | tee "$OUT/core_bench_step.log" | tail -24
fi
