#!/usr/bin/env bash
# Diagnoses two failure modes of the Gemma 3n decode bench on one H200 with
# benchmarks/diagnose_hf.py: a deferred-host hang at E2B batch 8 (a launch that waits for the
# GPU, which waits for a fill only the launching thread can make) and a reference that does
# not repeat itself (cuDNN attention); BENCHMARKS.md has the findings. Run from the repo
# root with the wheel installed (PYTHONPATH=/tmp/site:$PWD/tests). Every wait is bounded
# (watchdogs of 3 and 10 s, timeouts below). Writes under $OUT: pytest.log launch.log
# e2b.log summary.txt
# Wall time: about 8 minutes, 2-3 of them building and loading the E2B-shaped checkpoint
# (shared with scripts/gpu/hf.sh through PLE_MEMOPS_CACHE: less if hf.sh built it).
# QUICK=1: only the synthetic launch test and the tiny-model tests (about 2 minutes).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the folder that comes back}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PLE_MEMOPS_CACHE=${PLE_MEMOPS_CACHE:-/tmp/ple_memops_cache}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
T0=$SECONDS
RC=0
run() {  # run NAME TIMEOUT LOG CMD...: bounded, logged, failures counted, never fatal
    local name=$1 limit=$2 log=$3
    shift 3
    echo "== $name (t=$((SECONDS - T0)) s, limit ${limit} s)" | tee -a "$log"
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    local r=$?
    if [ $r -ne 0 ]; then
        echo "!! $name: rc=$r$([ $r -ge 124 ] && echo ' (timed out)')" | tee -a "$log"
        RC=1
    fi
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/summary.txt" 2>&1
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >>"$OUT/summary.txt" 2>&1

# 1. The synthetic launch test: does graph.replay() hold the host until the rows' wait is
#    passed, when the launching thread is the one that fills? (about 1 minute)
run "launch: a staged consumer before N kernels, filled inline or from a thread" 200 \
    "$OUT/launch.log" $PY benchmarks/diagnose_hf.py --parts launch

# 2. E2B shapes: the reference replayed back to back, after the eager check, after other
#    variants (state checksums each time); then deferred-host at batch 8, inline and thread.
if [ "${QUICK:-0}" != 1 ]; then
    run "E2B: determinism bisect (batch 1, 256 steps), deferred-host hang (batch 8)" 600 \
        "$OUT/e2b.log" $PY benchmarks/diagnose_hf.py --parts determinism,hang
fi

# 3. The tiny model through the runner (every variant; deferred-host's ids through the worker
#    on both copy paths) and the core tests of host ids behind thousands of kernels.
run "pytest (tiny Gemma 3n: every variant; host ids through the worker)" 240 "$OUT/pytest.log" \
    $PY -m pytest tests/test_transformers_gpu.py tests/test_async_gpu.py tests/test_worker_gpu.py \
    -k "every_variant or through_the_worker or staged_host_fill or behind_thousands" -q -rs -p no:cacheprovider

{
    echo "== launch (copy kernels where fill | launch ms | fill ms | result)"
    grep -E "^(kernel|memop) " "$OUT/launch.log"
    echo "== E2B"
    [ -f "$OUT/e2b.log" ] && grep -E "^==|replay|eager|itself|differ|DIFFER|Error|MATH|EFFICIENT|CUDNN|step [0-9]+|deferred-host|gpu-table|\(.* s\)" "$OUT/e2b.log" | head -80
    echo "== pytest"
    grep -E "passed|failed|error" "$OUT/pytest.log"
    echo "== wall time $((SECONDS - T0)) s, rc=$RC"
} >>"$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
exit $RC
