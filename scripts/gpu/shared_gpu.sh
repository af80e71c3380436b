#!/usr/bin/env bash
# Where the deferred graphs' excess beside other servers on one GPU comes from. Alone on
# the GPU an mmap server's decode graphs run within ~20 us of the GPU table's at equal batch
# sizes; Gemma's, with other (idle) servers started on the same H200, ran +250-500 us longer,
# without any gather behind them too (docs/vllm.md, "Sharing the GPU with other
# processes"; this script's Qwen4Exp run on an H100: BENCHMARKS.md, "Servers sharing one
# GPU"). Each run below starts its servers together and measures them one at a time
# (the benchmark's side-by-side mode), graphs timed, on the benchmark's Qwen4Exp (four 1 GiB
# BF16 tables), small KV caches so that the servers fit one card (MODEL below: another model):
#
#   1. side    the GPU table, mmap with the polling kernel (an SM spins on the flag) and mmap
#              with memops (the channel blocks on cuStreamWaitValue64), side by side
#   2. mps     the same servers under MPS (one shared context: no time slicing between the
#              servers' contexts), where the image has nvidia-cuda-mps-control; its daemon
#              is started for the run and told to quit after it
#
# What each outcome says, written before it ran: the excess gone under MPS and present in
# both copy paths without it -> time slicing between contexts; present under MPS too ->
# not the contexts' scheduling; present with memops only -> the blocked wait.
#
# MODEL chooses the servers' model (default qwen4exp, the run above):
#   qwen4exp       four 1 GiB BF16 tables, 2 GiB KV caches; SERVERS (default)
#                  gpu-plugin,mmap-kernel,mmap-memop
#   gemma3n-e2b    the models whose servers ran slower side by side (H200 hosts, vLLM
#   gemma4-e4b     0.33.0), 4 GiB KV caches, 64 tokens out; SERVERS (default)
#                  gpu-plugin,mmap,mmap-split,mmap-nogather: the default (split rows, the
#                  rest's table on 8 gather threads of its own held awake while a step is
#                  armed), the same on the shared pool's threads only, and the protocol
#                  without a gather. Gemma 4 runs only where vLLM does not route its
#                  attention to FlashAttention 4 (not in the 0.34.0 bundle on Hopper).
# The outputs' TAG is shared (shared_mps) for qwen4exp, shared_<model> (shared_<model>_mps)
# otherwise.
#
# Run from the repository root after vLLM's setup.sh (scripts/vllm-h200/), our wheel in
# /tmp/site; each run writes under $OUT as scripts/gpu/vllm_bench.sh does. About 7 minutes a
# run on a warm host (CONC=8,64 REPEATS=2: about 4): start it with scripts/gpu/detached.sh.
set -uo pipefail
OUT=${OUT:-/tmp/ple-out}
mkdir -p "$OUT"
MODEL=${MODEL:-qwen4exp}
case "$MODEL" in
qwen4exp)
    MODEL_ARGS="--layers 24 --ple-layers 4 --table-gib 4 --dtype bf16 --kv-cache-gib 2"
    SERVERS=${SERVERS:-gpu-plugin,mmap-kernel,mmap-memop}
    TAG=shared
    ;;
gemma3n-e2b | gemma4-e4b)
    MODEL_ARGS="--model $MODEL --kv-cache-gib 4 --output-len 64"
    SERVERS=${SERVERS:-gpu-plugin,mmap,mmap-split,mmap-nogather}
    TAG=shared_$MODEL
    ;;
*) echo "unknown MODEL=$MODEL (qwen4exp, gemma3n-e2b or gemma4-e4b)"; exit 2 ;;
esac
ARGS="$MODEL_ARGS --time-graphs --concurrency ${CONC:-1,8,64} --mixed-long 0 \
--repeats ${REPEATS:-3} --ref gpu-plugin --backends $SERVERS"
# The GPU's time-slice policy, read only (nothing here changes the card's settings).
nvidia-smi compute-policy -l >"$OUT/${TAG}_timeslice.txt" 2>&1 || true
head -5 "$OUT/${TAG}_timeslice.txt"
echo "== side by side, separate contexts"
DEADLINE=${DEADLINE:-420} TAG=$TAG BENCH_ARGS="$ARGS" bash scripts/gpu/vllm_bench.sh
if ! command -v nvidia-cuda-mps-control >/dev/null; then
    echo "== no nvidia-cuda-mps-control on this image: the MPS run is not made"
    exit 0
fi
echo "== side by side under MPS"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/ple-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ple-mps/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "MPS did not start"; exit 1; }
trap 'echo quit | nvidia-cuda-mps-control' EXIT
DEADLINE=${DEADLINE:-420} TAG=${TAG}_mps BENCH_ARGS="$ARGS" bash scripts/gpu/vllm_bench.sh
cp "$CUDA_MPS_LOG_DIRECTORY"/control.log "$OUT/${TAG}_mps_control.log" 2>/dev/null || true
