#!/usr/bin/env bash
# Where a deferred step's time goes, on an H200: the stall-timing GPU tests, then the
# ablation ladder of `vllm serve` servers at c64 on the benchmark model with one 24 GiB BF16
# PLE table on decoder layer 0, interleaved and paired round by round. Run from the
# repository root after scripts/vllm-h200/setup.sh, with our wheel in /tmp/site; logs go to
# $OUT. One part a device call (each fits the 10-minute limit):
#
#   PART=checks  the GPU tests of stall timing, the gather-free fill and the runner hooks
#                (~2 min), then the benchmark checkpoint written once under /tmp (~2 min)
#   PART=gpu     ladder, GPU side: gpu, gpu-plugin (the plugin installed, switched off),
#                mmap; paired against gpu (~6 min on a fresh host)
#   PART=mmap    ladder, mmap side: mmap, mmap-b (A against A), mmap-nogather (the protocol
#                without the host's gather), mmap-lead (first_layer_threads); paired
#                against mmap (~5 min on a warm host), then the engine test of stall
#                timing (the stock engine's tokens, ~2 min)
#   PART=results gpu-plugin (the GPU table, the plugin installed), mmap, mmap-b (A
#                against A) at c1, c8 and c64, every server with the graphs' clock:
#                whether the engine's thread waits for a step's results ("results wait"),
#                so whether a GPU stall is on the critical path at each load; the launch
#                call's host time beside the GPU table's; paired against gpu-plugin
#   PART=solo    the targets' run: gpu-plugin, mmap, gpu-plugin-b (A against A), uva, each
#                server alone on the GPU (--solo) at c1, c8, c64 and the mixed load, the
#                graphs' clock on the plugin's servers; paired against gpu-plugin's median.
#                Long: start it detached (~14 min with the engine tests after it,
#                BENCHMARKS.md "Each server alone on the GPU"), e.g.
#                  bash scripts/gpu/detached.sh start solo env PART=solo bash scripts/gpu/step_costs.sh
#                  bash scripts/gpu/detached.sh collect solo 540   # again until exit 0
#   PART=solo4   the same on the bench's default model (24 layers, four 1 GiB tables)
#   PART=disk4   that model, vLLM 0.34.0's disk offload in uva's place (vLLM 0.34.0 set up)
#   PART=hostcost our hooks' host time a step without an engine (benchmarks/bench_hooks.py) on
#                this host's CPU: caches evicted by 96 MiB (the hooks, then through our
#                runner over vLLM's classes) and by twice the L3 between steps, then
#                asleep; one and four tables (~3 min); the clock source and the CPU in
#                $OUT/hostcost_env.txt
#
# The two server sets cannot share the GPU: three GPU-table servers hold 3 x 37 GiB.
set -uo pipefail
OUT=${OUT:-/tmp/ple-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONPATH=${VLLM_SITE:-/tmp/vllm-site}:/tmp/site:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
R=$PWD
MODEL=(--layers 24 --ple-layers 1 --table-gib 24 --dtype bf16)
LOAD=(--kv-cache-gib 6 --concurrency 64 --requests 256 --mixed-long 0 --repeats "${REPEATS:-5}"
      --start-timeout 300 --load-timeout 60)
SOLO=(--kv-cache-gib 6 --solo --time-graphs --backends gpu-plugin,mmap,gpu-plugin-b,uva
      --ref gpu-plugin --repeats "${REPEATS:-5}")
case "${PART:?PART=checks|gpu|mmap|results|solo|solo4|disk4|hostcost}" in
hostcost)
    { lscpu | grep -E "Model name|L2|L3"
      echo "clock source: $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource)"
    } | tee "$OUT/hostcost_env.txt"
    for between in "--evict-mib 96" "--evict-mib 96 --through runner" "" "--between sleep"; do
        echo "== bench_hooks ${between:-evicting twice the L3}"
        # shellcheck disable=SC2086
        timeout 150 python3 benchmarks/bench_hooks.py --steps 600 --repeats 2 --native-split \
            $between 2>&1 \
            | tail -6
    done | tee "$OUT/hostcost.txt"
    ;;
checks)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
    (cd /tmp && timeout 300 python3 -m pytest "$R/tests/test_stall_gpu.py" \
        "$R/tests/test_vllm_runner_gpu.py" "$R/tests/test_worker_gpu.py" \
        "$R/tests/test_deferred_gpu.py" -v -s -rs -p no:cacheprovider \
        -W ignore::DeprecationWarning 2>&1) >"$OUT/checks_pytest.log"
    echo "== pytest exit $?"
    grep -E "PASSED|FAILED|ERROR|SKIPPED|filled first|hidden:|worker replays" \
        "$OUT/checks_pytest.log" | sed 's/^.*tests\//  /' | cut -c1-240 | head -60
    tail -1 "$OUT/checks_pytest.log"
    timeout 240 python3 benchmarks/bench_vllm.py "${MODEL[@]}" --build-only 2>&1 | tail -4
    ;;
gpu)
    DEADLINE=${DEADLINE:-470} TAG=ladder_gpu BENCH_ARGS="${MODEL[*]} ${LOAD[*]} \
        --backends gpu,gpu-plugin,mmap --ref gpu" bash scripts/gpu/vllm_bench.sh
    ;;
results)
    # Decode loads only, each concurrency's default request count (max(8, 6c)).
    DEADLINE=${DEADLINE:-480} TAG=ladder_results BENCH_ARGS="${MODEL[*]} --kv-cache-gib 6 \
        --concurrency 1,8,64 --mixed-long 0 --repeats ${REPEATS:-5} --start-timeout 300 \
        --load-timeout 60 --backends gpu-plugin,mmap,mmap-b --ref gpu-plugin \
        --time-graphs" bash scripts/gpu/vllm_bench.sh
    ;;
solo)
    DEADLINE=${DEADLINE:-820} TAG=solo24 BENCH_ARGS="${MODEL[*]} ${SOLO[*]}" \
        bash scripts/gpu/vllm_bench.sh
    ;;
solo4)
    DEADLINE=${DEADLINE:-760} TAG=solo4 BENCH_ARGS="--layers 24 --dtype bf16 ${SOLO[*]}" \
        bash scripts/gpu/vllm_bench.sh
    ;;
disk4)
    # vLLM 0.34.0 and later: its own disk offload beside the GPU table, its A/A twin and mmap.
    DEADLINE=${DEADLINE:-500} TAG=disk4 BENCH_ARGS="--layers 24 --dtype bf16 --kv-cache-gib 6 \
        --solo --time-graphs --backends gpu-plugin,disk,mmap,gpu-plugin-b --ref gpu-plugin \
        --repeats ${REPEATS:-5}" bash scripts/gpu/vllm_bench.sh
    ;;
mmap)
    DEADLINE=${DEADLINE:-330} TAG=ladder_mmap BENCH_ARGS="${MODEL[*]} ${LOAD[*]} \
        --backends mmap,mmap-b,mmap-nogather,mmap-lead --ref mmap" bash scripts/gpu/vllm_bench.sh
    (cd /tmp && timeout 200 python3 -m pytest "$R/tests/test_vllm_engine_gpu.py" -k stall_timing \
        -v -s -rs -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::FutureWarning \
        -W ignore::UserWarning 2>&1) >"$OUT/engine_stall_pytest.log"
    echo "== engine stall test: exit $?"
    grep -E "PASSED|FAILED|ERROR|stall timing|steps" "$OUT/engine_stall_pytest.log" | cut -c1-400 | head
    tail -1 "$OUT/engine_stall_pytest.log"
    ;;
esac
