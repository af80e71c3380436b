#!/usr/bin/env bash
# Gemma 4 and Gemma 3n in the real vLLM engine (0.33.0 or 0.34.0) on a GPU, ple-memops installed as
# its plugin: the engine tests (tests/test_vllm_gemma4_engine_gpu.py, then
# tests/test_vllm_gemma3n_engine_gpu.py with the wheels of scripts/gpu/gemma3n_wheels.sh
# when .gemma3n-wheels/ was carried, else it skips), then `vllm serve` of the tiny Gemma 4
# with the environment switch and an HTTP client on localhost. Run from the
# repository root after .vllm-bundle/RELEASE/<last part>/setup.sh (vLLM in $VLLM_SITE (default /tmp/vllm-site: the release setup.sh unpacked last)) with our wheel in
# /tmp/site; logs go to $OUT. Wall time: about 5 minutes on a fresh host (the first
# engines compile vLLM's Triton kernels and the model's Inductor graphs). DIAG=1 runs
# benchmarks/compare_gemma4_engines.py after the tests (stock, mmap and mmap without async
# scheduling against each other, rows checked on the device; about 3 minutes more).
# Measured on the H200: the Gemma 4 module 5.5 minutes. GEMMA4=0 skips it, GEMMA3N=0 the
# Gemma 3n module, SERVE=0 `vllm serve`; K=expr runs only the tests pytest's -k selects.
set -uo pipefail
. "$(dirname "$0")/gpu_lock.sh" && gpu_lock vllm_gemma4.sh
OUT=${OUT:-/tmp/ple-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONPATH=${VLLM_SITE:-/tmp/vllm-site}:/tmp/site:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
R=$PWD
rc=0
if [ "${GEMMA4:-1}" = 1 ]; then
    start=$(date +%s)
    (cd /tmp && timeout "${ENGINE_LIMIT:-420}" python3 -m pytest \
        "$R/tests/test_vllm_gemma4_engine_gpu.py" ${K:+-k "$K"} -v -s -rs -p no:cacheprovider \
        -W ignore::DeprecationWarning -W ignore::FutureWarning -W ignore::UserWarning 2>&1) \
        >"$OUT/gemma4_pytest.log"
    rc=$?
    echo "== gemma4 engine: pytest exit $rc in $(( $(date +%s) - start )) s (124 = hit the time limit)"
    grep -E "PASSED|FAILED|ERROR|SKIPPED|scheduling:|plan:|what the engine raised" \
        "$OUT/gemma4_pytest.log" | sed 's/^.*tests\//  /' | head -40
    if [ $rc -ne 0 ]; then
        sed -n '/= FAILURES =/,$p' "$OUT/gemma4_pytest.log" | grep -E "^(E |FAILED|___)" | head -40
    fi
    tail -1 "$OUT/gemma4_pytest.log"
fi
if [ "${GEMMA3N:-1}" = 1 ]; then
    extra=""
    if ls .gemma3n-wheels/*.whl >/dev/null 2>&1; then
        rm -rf /tmp/site-gemma3n
        python3 -m pip install -q --no-deps --target /tmp/site-gemma3n .gemma3n-wheels/*.whl
        extra=/tmp/site-gemma3n
    elif [ -d /tmp/site-gemma3n ]; then
        extra=/tmp/site-gemma3n  # installed by an earlier call on this host
    fi
    start=$(date +%s)
    (cd /tmp && PYTHONPATH=$PYTHONPATH${extra:+:$extra} timeout "${GEMMA3N_LIMIT:-300}" \
        python3 -m pytest "$R/tests/test_vllm_gemma3n_engine_gpu.py" ${K:+-k "$K"} -v -s -rs \
        -p no:cacheprovider \
        -W ignore::DeprecationWarning -W ignore::FutureWarning -W ignore::UserWarning 2>&1) \
        >"$OUT/gemma3n_pytest.log"
    g3=$?
    echo "== gemma3n engine: pytest exit $g3 in $(( $(date +%s) - start )) s"
    grep -E "PASSED|FAILED|ERROR|SKIPPED|scheduling:" "$OUT/gemma3n_pytest.log" \
        | sed 's/^.*tests\//  /' | head -10
    [ $g3 -ne 0 ] && sed -n '/= FAILURES =/,$p' "$OUT/gemma3n_pytest.log" \
        | grep -E "^(E |FAILED|___)" | head -20
    [ $rc -eq 0 ] && rc=$g3
fi
if [ "${DIAG:-0}" = 1 ]; then
    echo "== Gemma 4 engines against each other (benchmarks/compare_gemma4_engines.py)"
    timeout "${DIAG_LIMIT:-420}" python3 "$R/benchmarks/compare_gemma4_engines.py" \
        >"$OUT/gemma4_compare.log" 2>&1
    echo "== compare: exit $?"
    grep -E "^\|" "$OUT/gemma4_compare.log" | tail -6
fi
[ "${SERVE:-1}" = 1 ] || exit $rc
echo "== vllm serve (Gemma 4) with PLE_MEMOPS_TABLE_BACKEND=mmap"
timeout 360 python3 "$R/tests/vllm_serve_check.py" gemma4 2>&1 | tee "$OUT/gemma4_serve.log" | tail -8
src=${PIPESTATUS[0]}
echo "== serve: exit $src"
[ $rc -eq 0 ] && exit $src
exit $rc
