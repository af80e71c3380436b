#!/usr/bin/env bash
# Debug: does an mmap server with copy="kernel" hang at its first FULL capture (the 24-layer
# bench server did, at "Capturing CUDA graphs (FULL): 0/9")? One server of the 24-layer
# bench model; if it is still capturing STUCK s after the capture began, its GPU state is
# sampled and it gets SIGABRT: faulthandler prints every Python thread's stack into its
# log. Logs under $OUT/probe.
set -uo pipefail
OUT=${OUT:?}
LIMIT=${LIMIT:-300}
STUCK=${STUCK:-40}
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_BREAKABLE_CUDAGRAPH=0 PYTHONFAULTHANDLER=1
export PYTHONPATH=/tmp/vllm-site:/tmp/site:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
unset PLE_MEMOPS_TABLE_BACKEND
mkdir -p "$OUT/probe"
A=(--layers 24 --kv-cache-gib 6 --backends mmap-kernel --repeats 1 --concurrency 1,64 --mixed-long 0 --start-timeout "$LIMIT" --load-timeout 30 --log-dir "$OUT/probe")
timeout $((LIMIT + 60)) python3 benchmarks/bench_vllm.py "${A[@]}" --deadline $((LIMIT + 30)) > "$OUT/probe/bench.log" 2>&1 &
f="$OUT/probe/server-mmap-kernel.log"
t0=$SECONDS; cap=""
while [ $((SECONDS - t0)) -lt "$LIMIT" ]; do
    sleep 3
    grep -q "Graph capturing finished" "$f" 2>/dev/null && { echo "== captured: $(grep -o 'Graph capturing finished.*' "$f")"; break; }
    if [ -z "$cap" ] && grep -q "Capturing CUDA graphs" "$f" 2>/dev/null; then cap=$SECONDS; echo "== capture began at $((SECONDS - t0)) s"; fi
    if [ -n "$cap" ] && [ $((SECONDS - cap)) -ge "$STUCK" ]; then
        echo "== still capturing after $STUCK s"
        nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
        for p in $(pgrep -f "EngineCore"); do
            echo "-- pid $p threads:"; for t in /proc/$p/task/*; do echo "$(cat $t/comm) $(cat $t/wchan 2>/dev/null)"; done | sort | uniq -c
            kill -ABRT "$p"
        done
        break
    fi
done
sleep 6
wait
echo "== stacks"
grep -nE "Thread 0x|Current thread|File \"" "$f" | grep -vE "threading.py|selectors|asyncio|concurrent/futures|queue.py|qwen_gdn_linear_attn.py:14" | tail -70 | cut -c1-220
grep -E "^\[ *[0-9.]+ s\] r1" "$OUT/probe/bench.log" | head -4
