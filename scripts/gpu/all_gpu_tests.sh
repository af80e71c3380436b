#!/usr/bin/env bash
# Every GPU test of tests/ on one host in one device call, after the bundle's two part
# uploads (scripts/vllm-h200/README.md): set vLLM up, install our wheel (dist/), run the
# real-engine tests (scripts/gpu/vllm_engine.sh), then every other GPU test (the core, the
# runner hooks' stand-in, transformers), then, time permitting, the stock-vs-mmap diagnostic
# (benchmarks/diagnose_vllm_rows.py). Each part is bounded; logs go to $OUT. Run from the
# repository root with carry [".vllm-bundle/RELEASE/<last part>", "dist"] (VLLM_RELEASE, default 0.34.0). Wall time: about 8 minutes on a
# fresh host (the first engine compiles vLLM's Triton kernels).
#   ENGINE_LIMIT=440  seconds for the engine tests    SERVE=0|1  also `vllm serve` (+~60 s)
#   CORE_LIMIT=150    seconds for the other GPU tests DIAG=0     skip the diagnostic
set -uo pipefail
OUT=${OUT:?set OUT to the folder that comes back}
R=$PWD
if ! bash .vllm-bundle/"${VLLM_RELEASE:-0.34.0}"/*/setup.sh >"$OUT/setup.log" 2>&1; then
    echo "!! vLLM setup failed:"; tail -5 "$OUT/setup.log"; exit 1
fi
tail -1 "$OUT/setup.log"
rm -rf /tmp/site && python3 -m pip install -q --no-deps --target /tmp/site dist/*.whl || exit 1
ENGINE_LIMIT=${ENGINE_LIMIT:-440} SERVE=${SERVE:-0} OUT=$OUT bash scripts/gpu/vllm_engine.sh
erc=$?
echo "== the other GPU tests (limit ${CORE_LIMIT:-150} s)"
# The engine file installs the plugin process-wide; test_vllm_real.py is the CPU environment's.
(cd /tmp && PYTHONPATH=/tmp/site:$R/tests timeout "${CORE_LIMIT:-150}" python3 -m pytest "$R/tests" \
    -q -rs -m gpu -p no:cacheprovider --ignore "$R/tests/test_vllm_engine_gpu.py" \
    --ignore "$R/tests/test_vllm_real.py" 2>&1) >"$OUT/core_gpu.log"
crc=$?
grep -E "passed|failed|error" "$OUT/core_gpu.log" | tail -3
if [ $crc -ne 0 ]; then
    grep -E "^(FAILED|ERROR)|^E " "$OUT/core_gpu.log" | head -30
fi
if [ "${DIAG:-1}" = 1 ] && [ $SECONDS -lt 420 ]; then
    # Stock in vLLM's default breakable graphs vs FULL graphs vs mmap (the mmap engines run
    # FULL decode graphs; the engine tests compare against stock in the same mode).
    echo "== diagnose: stock (breakable graphs) vs stock (FULL graphs) vs mmap"
    (cd /tmp && PYTHONPATH=${VLLM_SITE:-/tmp/vllm-site}:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 \
        timeout $((560 - SECONDS)) python3 -W ignore "$R/benchmarks/diagnose_vllm_rows.py" \
        --variants stock,stock-full,mmap 2>&1) >"$OUT/diag.log"
    grep -E "^\|" "$OUT/diag.log"
fi
echo "== engine rc=$erc, other GPU tests rc=$crc (124: hit the time limit)"
[ $erc -eq 0 ] && [ $crc -eq 0 ]
