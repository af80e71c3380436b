#!/usr/bin/env bash
# Where `vllm serve` of the tiny Qwen4Exp stops (vLLM 0.34.0 on the H100: an illegal memory
# access in the engine core's memory-profiling run, mmap backend; under compute-sanitizer's
# memcheck the only bad accesses are vLLM's FLA Triton kernel chunk_fwd_kernel_o reading
# shared memory out of bounds in the GDN prefill warm-up, docs/vllm.md#releases), one step
# at a time, each step's verdict on stdout and its log under $OUT:
#   1. the server with the mmap backend at the engine tests' sizes, then at the sizes
#      `vllm serve` picks itself (8,192 tokens a step on this card); both serve: nothing
#      more to find (exit 0); else, at the sizes that failed:
#   2. the server stock (the plugin off, FULL decode graphs as the mmap server has them):
#      vLLM's own failure or the plugin's;
#   3. an in-process mmap engine that is the first engine of a fresh process (the engine
#      tests always build a stock engine first), at the serve check's sizes;
#   4. mmap with the plugin's device side out of the way (PLE_MEMOPS_FORCE_SYNC=1: each
#      step's rows copied in plainly, no flag wait, no polling kernel);
#   5. mmap with the GDN layers' key and value head dims 64 instead of 16 (vLLM picks its
#      Triton prefill kernels by them);
#   6. the same as 1 with CUDA_LAUNCH_BLOCKING=1 (the traceback names the launch that faults;
#      on a fresh H100 host it gave no verdict within the check's 300 s health deadline);
#   7. with SANITIZER=1 and compute-sanitizer on the host: step 3's engine, mmap then stock,
#      each under its memcheck (SANITIZER_LIMIT seconds each, default 300).
# Run from the repository root after the release's setup.sh (vLLM in $VLLM_SITE, default
# /tmp/vllm-site) with our wheel in /tmp/site; 3-12 minutes on a fresh host (the first
# server compiles vLLM's Triton kernels), alone on the GPU (scripts/gpu/gpu_lock.sh).
set -uo pipefail
. "$(dirname "$0")/gpu_lock.sh" && gpu_lock vllm_serve_diag.sh
OUT=${OUT:-/tmp/ple-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONPATH=${VLLM_SITE:-/tmp/vllm-site}:/tmp/site:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
R=$PWD
SIZES=tests
CONFIG='{}'  # the tiny model's config overrides (tests/vllm_serve_check.py's CONFIG)
serve() {  # NAME BACKEND [env...]
    local name=$1 backend=$2
    shift 2
    echo "== $name ($SIZES sizes) $(date +%T)"
    env "$@" timeout 360 python3 "$R/tests/vllm_serve_check.py" qwen4exp "$backend" "$SIZES" \
        "$CONFIG" >"$OUT/$name.log" 2>&1
    echo "   exit $?; $(grep -E "requests served over HTTP|^PASS|^FAIL" "$OUT/$name.log" \
        | tr '\n' ' ')"
    grep -m3 -E "illegal memory access|Error:" "$OUT/$name.log" | cut -c1-240 | sed 's/^/   /'
    grep -q "^PASS" "$OUT/$name.log"
}
if serve mmap mmap; then
    SIZES=serve
    serve mmap-serve-sizes mmap && { echo "the mmap server serves at both sizes"; exit 0; }
fi
serve stock default
# A fresh process whose first engine is an in-process one (mmap or stock).
FRESH=$(mktemp -d)/fresh_engine.py
cat >"$FRESH" <<'EOF'
import os, sys, tempfile
from pathlib import Path

root, backend = sys.argv[1], sys.argv[2]
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_BREAKABLE_CUDAGRAPH="0",
                  PLE_MEMOPS_TABLE_BACKEND="mmap" if backend == "mmap" else "default")
sys.path[:0] = [f"{root}/tests", f"{root}/benchmarks"]
import vllm_checkpoints as ckpts
from vllm_harness import bundle_substitutes, close, engine, engine_workload, generate

bundle_substitutes()
ckpt = ckpts.write_checkpoint(Path(tempfile.mkdtemp()) / "ckpt", fp8=False,
                              max_position_embeddings=8192)
llm = engine(ckpt, backend)
print("generated", sum(len(b) for b in generate(llm, engine_workload()[:1])), "requests")
close(llm)
print("PASS: the first engine of a fresh process serves")
EOF
echo "== fresh process, in-process mmap engine first $(date +%T)"
(cd /tmp && timeout 300 python3 "$FRESH" "$R" mmap >"$OUT/fresh.log" 2>&1)
echo "   exit $?; $(grep -E "^PASS|^generated" "$OUT/fresh.log" | tr '\n' ' ')"
grep -m3 -E "illegal memory access|Error:" "$OUT/fresh.log" | cut -c1-240 | sed 's/^/   /'
serve mmap-forcesync mmap PLE_MEMOPS_FORCE_SYNC=1
CONFIG='{"linear_key_head_dim": 64, "linear_value_head_dim": 64}' serve mmap-k64 mmap
serve mmap-blocking mmap CUDA_LAUNCH_BLOCKING=1
grep -B2 -A14 -m1 "Traceback" "$OUT/mmap-blocking.log" | grep -E 'File "|Error' | tail -14 \
    | cut -c1-200 | sed 's/^/   /'
if [ "${SANITIZER:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
    for backend in mmap stock; do  # each engine first in its process, under memcheck
        echo "== $backend in-process engine under compute-sanitizer $(date +%T)"
        (cd /tmp && timeout "${SANITIZER_LIMIT:-300}" compute-sanitizer --tool memcheck \
            --print-limit 8 python3 "$FRESH" "$R" "$backend" >"$OUT/sanitizer-$backend.log" 2>&1)
        echo "   exit $?"
        grep -m12 -E "^========= +(Invalid|at |by thread|Access)|ERROR SUMMARY|^PASS" \
            "$OUT/sanitizer-$backend.log" | cut -c1-200 | sed 's/^/   /'
    done
fi
