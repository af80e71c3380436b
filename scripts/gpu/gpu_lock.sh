# Sourced (not run) by the scripts under scripts/gpu that start vLLM engines: one such
# script at a time on a host. vLLM sizes its KV cache from the GPU memory free while it
# profiles at start-up, so an engine starting beside another that allocates or frees
# meanwhile fails ("Error in memory profiling", or "No available memory for the cache
# blocks"; four suites started side by side on an H100: 27 of 33 tests failed so), and a
# benchmark beside anything measures the neighbour too.
#
#   . scripts/gpu/gpu_lock.sh && gpu_lock "what this script is"
#
# holds an exclusive flock on $PLE_GPU_LOCK (default /tmp/ple-gpu.lock) until the script
# and every process it started that kept the descriptor have exited; a second script waits
# for it, saying so, at most $PLE_GPU_LOCK_WAIT seconds (default 3600; then exit 3). A
# script started by one that holds the lock (PLE_GPU_LOCK_HELD in its environment) goes
# on without waiting for its own parent.
gpu_lock() {
    local what=${1:-a GPU script}
    local lock=${PLE_GPU_LOCK:-/tmp/ple-gpu.lock}
    if [ "${PLE_GPU_LOCK_HELD:-}" = "$lock" ]; then
        return 0
    fi
    command -v flock >/dev/null || { echo "gpu_lock: no flock here; $what runs unlocked" >&2; return 0; }
    exec 9>>"$lock"
    if ! flock -n 9; then
        echo "== $what waits for the GPU: another script holds $lock ($(date +%T))"
        if ! flock -w "${PLE_GPU_LOCK_WAIT:-3600}" 9; then
            echo "== $what gave up waiting for $lock" >&2
            exit 3
        fi
        echo "== $what has the GPU ($(date +%T))"
    fi
    export PLE_GPU_LOCK_HELD=$lock
}
