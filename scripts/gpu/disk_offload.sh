#!/usr/bin/env bash
# ple-memops' mmap backend against vLLM 0.34.0's own disk offload (`disk`), the GPU table
# (`gpu-plugin`, its A/A twin `gpu-plugin-b`) and vLLM's pinned default (`uva`), on the
# benchmark's Qwen4Exp, each server alone on the GPU (benchmarks/bench_vllm.py --solo). Run
# from the repository root after vLLM 0.34.0's setup.sh, our wheel in /tmp/site; each part
# writes under $OUT as scripts/gpu/vllm_bench.sh does. Parts longer than a device call:
# start them with scripts/gpu/detached.sh.
#
#   PART=warm4      four 1 GiB BF16 tables: c1, c8, c64, mixed (~14 min)
#   PART=warm24     one 24 GiB table on decoder layer 0: the same (~15 min)
#   PART=fp8        four 1 GiB FP8 tables at c64 (~8 min)
#   PART=residency  the 24 GiB table held at SHARES (default "1.0 0.5 0.1 0.0") of the page
#                   cache (benchmarks/residency.py, every backend alike): disk and mmap at
#                   c1, c8 and c64 per share (~6 min a share; CONC=1,64: fewer loads), then
#                   the storage floor on the same disk (benchmarks/bench_cold.py host --quick;
#                   FLOOR=first: before the shares, FLOOR=0: none; GPU_REF=0: no GPU-table
#                   server at 1.0, mmap's own 1.0 being the warm figure; TABLES=4x1: the
#                   four 1 GiB tables instead, tagged disk_res4x1_*; RES_BACKENDS: the
#                   servers at every share, default disk,mmap, e.g. disk,mmap,mmap.2 for
#                   an A/A pair of mmap servers; LOAD_TIMEOUT=150: the seconds a load may
#                   take before its unfinished requests count as failed, where `disk` at 0%
#                   needed more than the bench's default 90 s for c64's 384 requests)
#   PART=servers    host memory as servers of one checkpoint are added: 1, 2 and 4 mmap
#                   servers, then 1, 2 and 4 uva servers, c1 once each; the four 1 GiB
#                   tables on an 8-layer, 16-expert model with 1 GiB KV caches, so four
#                   servers fit one H100
#                   (~12 min; SERVERS="mmap uva" and COUNTS="1 2 4" choose); the report's
#                   "Host memory in use" line per run
#   PART=dp         the same model on a host of DP GPUs (default 2): per backend (SERVERS,
#                   default "mmap uva") one server of one rank, then one of DP
#                   data-parallel ranks (one a GPU), c1 and c8 once each (~10 min); the
#                   report's servers table gives each one's host memory
#   PART=beyond-ram the residency and servers parts in one detached job on a fresh host:
#                   the residency part
#                   (FLOOR=first, SHARES "1.0 0.0 0.5 0.1", CONC=1,64, REPEATS=1: the shares
#                   in the order that tells most if the job is cut short), the benchmark
#                   checkpoints removed (the 24 GiB one and the servers' do not both fit a
#                   64 GiB disk beside vLLM's bundle), then the servers part with COUNTS
#                   "1 4" (~35 min in all)
# benchmarks/disk_offload_report.py then tabulates the residency and servers runs' JSON and
# draws the residency curve.
set -uo pipefail
OUT=${OUT:-/tmp/ple-out}
mkdir -p "$OUT"
COMMON=(--layers 24 --kv-cache-gib 6 --solo --time-graphs --ref gpu-plugin
        --repeats "${REPEATS:-3}")
FOUR=(--ple-layers 4 --table-gib 4)
ONE24=(--ple-layers 1 --table-gib 24)
# The servers and dp parts' model: the four 1 GiB tables, small enough that four servers fit
# one H100, each load once.
SMALL=(--layers 8 --experts 16 "${FOUR[@]}" --dtype bf16 --kv-cache-gib 1 --mixed-long 0
       --repeats 1)
ALL=${BACKENDS:-gpu-plugin,disk,mmap,uva,gpu-plugin-b}  # BACKENDS=...: the warm parts' servers, in order
CKPT=${BENCH_CKPT_ROOT:-/tmp/ple-bench-ckpt}  # where bench_vllm.py keeps its checkpoints
bench() {  # TAG DEADLINE ARGS...
    local tag=$1 deadline=$2
    shift 2
    DEADLINE=$deadline TAG=$tag BENCH_ARGS="$* --ckpt-root $CKPT" bash scripts/gpu/vllm_bench.sh
}
case "${PART:?PART=warm4|warm24|fp8|residency|servers|dp|beyond-ram}" in
beyond-ram)
    PART=residency FLOOR=${FLOOR:-first} SHARES=${SHARES:-1.0 0.0 0.5 0.1} CONC=${CONC:-1,64} \
        REPEATS=${REPEATS:-1} bash "$0"
    df -h /tmp | tail -1
    rm -rf "$CKPT" /tmp/ple-cold
    PART=servers COUNTS=${COUNTS:-1 4} bash "$0"
    ;;
warm4) bench disk_warm4 "${DEADLINE:-800}" "${COMMON[*]} ${FOUR[*]} --dtype bf16 --backends $ALL" ;;
warm24) bench disk_warm24 "${DEADLINE:-860}" "${COMMON[*]} ${ONE24[*]} --dtype bf16 --backends $ALL" ;;
fp8)
    bench disk_fp8 "${DEADLINE:-420}" "${COMMON[*]} ${FOUR[*]} --dtype fp8 --concurrency 64 \
        --mixed-long 0 --backends gpu-plugin,disk,mmap,gpu-plugin-b"
    ;;
residency)
    floor() {
        echo "== the storage floor on this disk"
        PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} timeout 300 \
            python3 benchmarks/bench_cold.py host --dir /tmp/ple-cold --gib 2.5 --quick \
            2>&1 | tee "$OUT/storage_floor.txt" | tail -20
    }
    case "${TABLES:-24}" in
        24) RES_MODEL=("${ONE24[@]}") TAG_TABLES= ;;
        4x1) RES_MODEL=("${FOUR[@]}") TAG_TABLES=4x1_ ;;
        *) echo "unknown TABLES=$TABLES (24 or 4x1)"; exit 2 ;;
    esac
    if [ "${FLOOR:-last}" = first ]; then floor; fi
    # The first share's first server start compiles vLLM's kernels on a fresh host (206-207 s
    # on H100 hosts, the next starts 46-59 s): 210 s more for it.
    extra=210
    for share in ${SHARES:-1.0 0.5 0.1 0.0}; do
        backends=${RES_BACKENDS:-disk,mmap}
        if [ "$share" = 1.0 ] && [ "${GPU_REF:-1}" != 0 ]; then backends=gpu-plugin,$backends; fi
        bench "disk_res${TAG_TABLES}${share/./}" "$((${DEADLINE:-330} + extra))" "${COMMON[*]} ${RES_MODEL[*]} --dtype bf16 \
            --concurrency ${CONC:-1,8,64} --mixed-long 0 --residency $share --backends $backends \
            --ref ${backends%%,*} --load-timeout ${LOAD_TIMEOUT:-150}"
        extra=0
    done
    if [ "${FLOOR:-last}" = last ]; then floor; fi
    ;;
servers)
    for b in ${SERVERS:-mmap uva}; do
        for n in ${COUNTS:-1 2 4}; do
            set=$b
            for k in $(seq 2 $n); do set="$set,$b.$k"; done
            bench "servers_${b}_$n" "${DEADLINE:-240}" "${SMALL[*]} --concurrency 1 \
                --backends $set --ref $b"
        done
    done
    ;;
dp)
    for b in ${SERVERS:-mmap uva}; do
        for ranks in 1 "${DP:-2}"; do
            bench "dp_${b}_$ranks" "${DEADLINE:-240}" "${SMALL[*]} --concurrency 1,8 \
                --backends $b --ref $b --data-parallel-size $ranks"
        done
    done
    ;;
*) echo "unknown PART=$PART"; exit 2 ;;
esac
