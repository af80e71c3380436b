#!/usr/bin/env bash
# The real vLLM engine at tensor parallel 2 on a two-GPU host (two H200s)
# (tests/vllm_tp2_check.py: mmap against stock, BF16 and FP8, async scheduling on and off,
# rank 1 forced onto the synchronous fallback). Run from the repository root after
# .vllm-bundle/RELEASE/<last part>/setup.sh (vLLM in $VLLM_SITE (default /tmp/vllm-site: the release setup.sh unpacked last)) with our wheel in /tmp/site; logs under
# $OUT/tp2. Wall time: about 7 engines of 40-60 s each. The TP 2 benchmark is then
#   BENCH_ARGS="--tensor-parallel-size 2 --layers 24 --kv-cache-gib 6 --repeats 3" \
#       bash scripts/gpu/vllm_bench.sh
# Not yet run on a two-GPU host.
set -uo pipefail
. "$(dirname "$0")/gpu_lock.sh" && gpu_lock vllm_tp2.sh
OUT=${OUT:-/tmp/ple-out}
mkdir -p "$OUT/tp2"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONPATH=${VLLM_SITE:-/tmp/vllm-site}:/tmp/site:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$OUT/tp2_env.txt"
timeout "${TP2_LIMIT:-560}" python3 tests/vllm_tp2_check.py --out "$OUT/tp2" 2>&1 \
    | tee "$OUT/tp2/check.log" | grep -E "PASS|FAIL|SKIP|^  |logs and" | tail -40
rc=${PIPESTATUS[0]}
echo "== tp2 check: exit $rc (124: hit the time limit; 2: fewer than two GPUs)"
exit $rc
