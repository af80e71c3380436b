#!/usr/bin/env bash
# benchmarks/bench_vllm.py on an H200: three `vllm serve` servers of a random-weight
# Qwen4Exp (PLE tables on the GPU, pinned + UVA, and ple-memops' mmap), or with
# BENCH_ARGS="--model gemma4-e2b" (or gemma4-e4b, gemma3n-e2b, gemma3n-e4b) of a Gemma at
# E2B's or E4B's shapes (its table on the GPU, vLLM's --cpu-offload-gb of the table's bytes, and mmap),
# interleaved loads, the table in BENCHMARKS.md form. Run from the repository root after
# scripts/vllm-h200/setup.sh (vLLM in $VLLM_SITE (default /tmp/vllm-site: the release setup.sh unpacked last), our wheel in /tmp/site), as
# scripts/gpu/vllm_engine.sh is. Writes under $OUT: bench_vllm_<tag>.{log,md,json},
# bench_env.txt and bench_logs_<tag>.tgz (the servers' logs, server-<backend>.log, and
# with --vllm-bench the commands' logs and JSON, cli-*).
#
# The checkpoint is written once per configuration under /tmp/ple-bench-ckpt (a hash of
# the config names it; about 17 GiB at the defaults) and reused while the host lives.
#
# Settings (environment):
#   DTYPE=bf16|fp8   the PLE tables' dtype (default bf16)
#   TAG=...          names the outputs (default: DTYPE)
#   DEADLINE=480     seconds after which the bench starts no new measurement (all phases:
#                    checkpoint, server start, warm-up, loads); the whole script stays
#                    under DEADLINE + 90 s
#   SMOKE=1          the tiny model, one repeat: checks the plumbing in ~3 minutes
#   BENCH_ARGS=...   more arguments, e.g. "--profile-steps 40" (each server's FULL graphs
#                    profiled with vLLM's torch profiler after the loads), "--py-spy 3
#                    --py-spy-bin /tmp/pyspy/bin/py-spy" (each engine core process's stacks
#                    sampled under each concurrency, bench_stacks_<tag>.tgz; the device has
#                    no network: `pip download py-spy --no-deps -d .pyspy` here, carry
#                    .pyspy, `pip install --no-deps --target /tmp/pyspy .pyspy/*.whl`
#                    there), "--time-graphs" (the graphs' span on the GPU and the time
#                    between them, mmap servers and gpu-plugin), "--cold" (evict the tables before the servers
#                    start and before each repeat; a live mmap server's mapped pages
#                    stay, so a cold mmap start is "--backends mmap --cold --no-warmup"),
#                    "--attention-every 4" (dense full
#                    attention every 4th layer), "--layers 16",
#                    "--output-len 256", "--repeats 5", "--backends gpu,mmap", "--compile default",
#                    "--vllm-bench latency,throughput" (vLLM's own offline benchmarks
#                    instead of the servers: one engine a run for each backend)
#
# Expected wall time on a fresh host at the defaults: checkpoint ~30-60 s (first time only),
# servers healthy after ~150-250 s (vLLM's Triton kernels compile on a fresh host; a warm
# host is faster), warm-up (every load once, all servers together) ~15 s, then ~25 s per
# backend a repeat at 24 layers (c1, c8, c64, mixed, on an H200).
set -uo pipefail
. "$(dirname "$0")/gpu_lock.sh" && gpu_lock vllm_bench.sh
OUT=${OUT:-/tmp/ple-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_BREAKABLE_CUDAGRAPH=0
export PYTHONPATH=${VLLM_SITE:-/tmp/vllm-site}:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
unset PLE_MEMOPS_TABLE_BACKEND  # the bench sets it in the mmap server only
DTYPE=${DTYPE:-bf16}
TAG=${TAG:-$DTYPE}  # names the outputs: two runs in one call need two tags
DEADLINE=${DEADLINE:-480}
EXTRA=()
if [ "${SMOKE:-0}" = 1 ]; then
    EXTRA=(--model tiny --repeats 1)
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
    python3 -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)'
    free -g | head -2
    df -h /tmp | tail -1
    python3 -m ple_memops.vllm check 2>&1 | tail -3
} 2>&1 | tee "$OUT/bench_env.txt"
start=$(date +%s)
# shellcheck disable=SC2086  # BENCH_ARGS is split on purpose
timeout -k 20 $((DEADLINE + 70)) python3 benchmarks/bench_vllm.py \
    --dtype "$DTYPE" --deadline "$DEADLINE" --log-dir "$OUT" \
    --markdown "$OUT/bench_vllm_$TAG.md" --json "$OUT/bench_vllm_$TAG.json" \
    ${EXTRA[@]+"${EXTRA[@]}"} ${BENCH_ARGS:-} >"$OUT/bench_vllm_$TAG.log" 2>&1
rc=$?
echo "== bench_vllm: exit $rc in $(( $(date +%s) - start )) s (124 = hit the time limit)"
# The progress lines, the table and the verdict (the full log is in $OUT).
grep -E "^\[ *[0-9.]+ s\]|^\||^VERDICT|^SOAK|^Soak of|^Random weights|Traceback|Error" "$OUT/bench_vllm_$TAG.log" \
    | grep -vE "Warning|warn" | tail -90
for f in "$OUT"/server-*.log "$OUT"/cli-*.log; do
    [ -f "$f" ] || continue
    # Error lines until the server is told to stop (vLLM's teardown logs a traceback); the
    # stop line is benchmarks/vllm_servers.py's STOPPING, which the report's markers use.
    n=$(sed -E '/\[shutdown\].*(trigger received signal|shutdown triggered)/q' "$f" | grep -cE "ERROR|Traceback")
    echo "== $(basename "$f"): $n error lines before the stop; key lines:"
    grep -E "Model loading took|Graph capturing finished|init engine|ple-memops|Skipped [0-9]+/|KV cache memory|deferred PLE rows|Throughput:|Avg latency" "$f" \
        | grep -v "ple-memops stats" | sed 's/^.*\] //' | cut -c1-220 | head -8
    grep "ple-memops stats" "$f" | tail -1 | sed 's/^.*\] //' | cut -c1-400
done
# At most 8 files come back from the device: the servers' and commands' logs in one archive.
logs=$(cd "$OUT" && ls server-*.log cli-*.log cli-*.json 2>/dev/null)
if [ -n "$logs" ]; then
    # shellcheck disable=SC2086  # one name a word
    tar -C "$OUT" -czf "$OUT/bench_logs_$TAG.tgz" $logs && (cd "$OUT" && rm -f $logs)
fi
# --profile-steps: the profiler's traces (summarised in the report) in one archive when they
# are small enough to come back, else left on the host.
if ls -d "$OUT"/profile-* >/dev/null 2>&1; then
    size=$(du -sm "$OUT"/profile-* | awk '{s += $1} END {print s}')
    if [ "${size:-0}" -le 48 ]; then
        (cd "$OUT" && tar -czf "bench_traces_$TAG.tgz" profile-* && rm -rf profile-*)
    else
        mkdir -p /tmp/ple-traces && mv "$OUT"/profile-* /tmp/ple-traces/
        echo "== traces (${size} MB) left in /tmp/ple-traces"
    fi
fi
# --py-spy: the engine core processes' collapsed stacks in one archive.
if ls "$OUT"/py-spy-*.txt >/dev/null 2>&1; then
    (cd "$OUT" && tar -czf "bench_stacks_$TAG.tgz" py-spy-*.txt && rm -f py-spy-*.txt)
fi
exit $rc
