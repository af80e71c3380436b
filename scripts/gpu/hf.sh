#!/usr/bin/env bash
# Gemma 3n and Qwen4Exp through transformers on one H200, their PLE tables served from the
# checkpoint, in captured graphs: the GPU tests, the demo and the decode bench. Run from the
# repo root with the wheel installed (PYTHONPATH=/tmp/site:$PWD/tests). Writes under $OUT
# (8 files at most):
#   pytest.log  demo.log (+ Qwen4Exp)  demo.png  bench.log  bench.md  bench.png  bench.json
#   summary.txt
# Wall time: about 7 minutes (an E2B step is ~6,000 small kernels: about 10 ms; the bench is
# ~60 runs of 256 steps and stops starting variants at its --deadline); SMOKE=1: about 2.5
# (a 6-layer E2B-width model, 32 steps, batch 1 and 64). FORCE=1: run the rest even if the
# gate fails. COLD=1: add a cold-page-cache bench (+~1.5 min). CPU_TESTS=1: add the CPU
# tests with this machine's torch and transformers (+~1 min).
# BENCH_MODEL=tiny runs the bench on the tiny model (a dry run of this script off the H200).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the folder that comes back}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SMOKE=${SMOKE:-0}
# The E2B-shaped checkpoint (8.8 GB, random weights) is built here on local disk, once.
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
        { echo "!! $name: rc=$r; the end of $(basename "$log"):"; tail -n 30 "$log"; } >>"$OUT/summary.txt"
        RC=1
    fi
}
if [ "$SMOKE" = 1 ]; then
    DEMO=(--steps 16 --batch 1,4)
    # E2B shapes cut to 6 layers (262,144 rows of 3,072 bytes), fewer steps: a correctness run
    BENCH=(--layers 6 --batch 1,64 --steps 32)
else
    DEMO=(--steps 64 --batch 1,4)
    BENCH=(--batch 1,8,64 --steps 256)
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$OUT/summary.txt" 2>&1
$PY -c "import torch, transformers, ple_memops; print('torch', torch.__version__, 'transformers', transformers.__version__, 'ple_memops', ple_memops.__file__)" >>"$OUT/summary.txt" 2>&1

# The gate: tiny Gemma 3n, every variant captured, checked against stock. If this fails the
# rest would too; skip the expensive part and keep the device time for a rerun.
run "pytest (GPU: Gemma 3n, every variant captured)" 150 "$OUT/pytest.log" \
    $PY -m pytest tests/test_transformers_gpu.py -k "not qwen" -q -rs -p no:cacheprovider
GATE=$RC

if [ "$GATE" = 0 ] || [ "${FORCE:-0}" = 1 ]; then
    run "demo (tiny Gemma 3n, every variant)" 100 "$OUT/demo.log" \
        $PY -m ple_memops demo "${DEMO[@]}" --png "$OUT/demo.png" --no-progress
fi

run "Qwen4Exp (eager through HF's code, deferred ids, capture attempt)" 60 "$OUT/demo.log" \
    $PY -c "import sys; from ple_memops.demo.checkpoints import default_cache_dir; from ple_memops.demo.cli import qwen_main; sys.exit(qwen_main(default_cache_dir(), steps=32))"

if [ "$GATE" = 0 ] || [ "${FORCE:-0}" = 1 ]; then
    # --deadline: past it no further variant starts, and what was measured is reported.
    run "bench (E2B shapes, warm page cache)" 330 "$OUT/bench.log" \
        $PY -m ple_memops bench --model "${BENCH_MODEL:-e2b}" "${BENCH[@]}" --styles sync,async \
        --placements early,late --deadline 230 \
        --markdown "$OUT/bench.md" --png "$OUT/bench.png" --json "$OUT/bench.json" --no-progress
    if [ "${COLD:-0}" = 1 ]; then
        run "bench (E2B shapes, cold page cache)" 90 "$OUT/bench.log" \
            $PY -m ple_memops bench --model "${BENCH_MODEL:-e2b}" --batch 1,64 --steps 64 \
            --styles sync,async --page-cache cold --variants gpu-table,sync-gather,deferred-device \
            --placements late --markdown "$OUT/bench.md" --no-progress
    fi
else
    echo "!! the GPU gate failed: demo and bench skipped (FORCE=1 runs them anyway)" | tee -a "$OUT/summary.txt"
fi

run "pytest (GPU: Qwen4Exp)" 60 "$OUT/pytest.log" \
    $PY -m pytest tests/test_transformers_gpu.py -k qwen -q -rs -p no:cacheprovider
if [ "${CPU_TESTS:-0}" = 1 ]; then
    run "pytest (CPU path with this machine's torch and transformers)" 90 "$OUT/pytest.log" \
        $PY -m pytest tests/test_transformers.py -q -rs -p no:cacheprovider
fi

{
    echo "== pytest"; grep -E "passed|failed|error" "$OUT/pytest.log"
    echo "== demo"; grep -E "runs: tokens|batch [0-9]+ (sync|async): best|DIFFER|skipped|Qwen4Exp|bit-identical to the stock|capture:|GPU memory|note:|!!" "$OUT/demo.log"
    echo "== bench"; grep -E "runs: tokens|best deferred|GPU memory|reference vs|DIFFER|!!|ready in|loaded" "$OUT/bench.log"
    echo "== wall time $((SECONDS - T0)) s, rc=$RC"
} >>"$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
exit $RC
