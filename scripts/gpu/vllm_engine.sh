#!/usr/bin/env bash
# The real vLLM engine (0.33.0 or 0.34.0) on a GPU, ple-memops installed as its plugin: the
# engine tests (tests/test_vllm_engine_gpu.py), then `vllm serve` with the environment
# switch and an HTTP client on localhost. Run from the repository root after
# scripts/vllm-h200/setup.sh (vLLM in $VLLM_SITE (default /tmp/vllm-site: the release setup.sh unpacked last)) with our wheel in /tmp/site; logs go
# to $OUT. Wall time: the engine tests alone take more than 7 minutes on a fresh host (the
# first engine compiles vLLM's Triton kernels; 9 of 12 ran in 400 s on 2026-12-04), so
# split them over two calls with K (pytest's -k expression), e.g. K="tokens_equal" then
# K="not tokens_equal"; `vllm serve` takes about 2 minutes more. SERVE=0 skips `vllm serve`,
# ENGINE_LIMIT the tests' time limit in seconds (default 420). Arguments are refused:
# settings come from the environment, as in scripts/gpu/vllm_gemma4.sh.
set -uo pipefail
. "$(dirname "$0")/gpu_lock.sh" && gpu_lock vllm_engine.sh
if [ $# -gt 0 ]; then
    echo "vllm_engine.sh takes no arguments (got: $*); select tests with K=expr" >&2
    exit 2
fi
OUT=${OUT:-/tmp/ple-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONPATH=${VLLM_SITE:-/tmp/vllm-site}:/tmp/site:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
R=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/engine_env.txt"
python3 -m ple_memops.vllm check 2>&1 | tee -a "$OUT/engine_env.txt"
PLE_MEMOPS_TABLE_BACKEND=mmap python3 -m ple_memops.vllm check 2>&1 | tee -a "$OUT/engine_env.txt"
start=$(date +%s)
(cd /tmp && timeout "${ENGINE_LIMIT:-420}" python3 -m pytest "$R/tests/test_vllm_engine_gpu.py" \
    ${K:+-k "$K"} -v -s -rs -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::FutureWarning \
    -W ignore::UserWarning 2>&1) >"$OUT/engine_pytest.log"
rc=$?
echo "== engine: pytest exit $rc in $(( $(date +%s) - start )) s (124 = hit the time limit)"
grep -E "PASSED|FAILED|ERROR|SKIPPED|mmap async=|what the engine raised" "$OUT/engine_pytest.log" \
    | sed 's/^.*tests\//  /' | head -40
if [ $rc -ne 0 ]; then
    sed -n '/= FAILURES =/,$p' "$OUT/engine_pytest.log" | grep -E "^(E |FAILED|___)" | head -40
fi
tail -1 "$OUT/engine_pytest.log"
[ "${SERVE:-1}" = 1 ] || exit $rc
# vllm serve: its engine core runs in another process, so the bundle's model substitute
# reaches it through a test-only vLLM plugin (write_test_plugin, tests/vllm_harness.py).
echo "== vllm serve with PLE_MEMOPS_TABLE_BACKEND=mmap"
timeout 360 python3 "$R/tests/vllm_serve_check.py" 2>&1 | tee "$OUT/serve.log" | tail -15
src=${PIPESTATUS[0]}
echo "== serve: exit $src"
if [ $src -ne 0 ]; then
    # The same server with the plugin off: is the failure ours or vLLM's on this host?
    echo "== vllm serve of the same model, the plugin off"
    timeout 360 python3 "$R/tests/vllm_serve_check.py" qwen4exp default 2>&1 \
        | tee "$OUT/serve_stock.log" | tail -4
    echo "== stock serve: exit ${PIPESTATUS[0]}"
fi
[ $rc -eq 0 ] && exit $src
exit $rc
