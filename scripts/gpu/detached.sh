#!/usr/bin/env bash
# Run a command past one device call's 10 minutes: the device machines kill what a call
# leaves running when it returns, except a process that started a session of its own
# (setsid), which runs on until the machine goes back (about 30 s after a call returns
# with no next call). So start the command detached in one call, keep the machine busy
# with the next calls (other work, or `collect` waiting), and collect its outputs.
#
#   bash scripts/gpu/detached.sh start NAME command [args...]
#       runs `command` in a new session, in a copy of this folder (NAME/src: the next call
#       rewrites the working tree), with OUT=/tmp/ple-detached/NAME/out (its own $OUT,
#       which survives the call), stdout and stderr in /tmp/ple-detached/NAME/log;
#       returns at once. A NAME already running is refused (exit 2).
#   bash scripts/gpu/detached.sh collect NAME [WAIT_S]
#       waits up to WAIT_S seconds (default 540) for NAME to end, then copies its outputs
#       and its log into this call's $OUT (as NAME.log) and prints the log's last 60 lines.
#       Exit: the command's status once it ended; 3 when it is still running (call
#       collect again); 2 when NAME was never started on this machine.
#   bash scripts/gpu/detached.sh status NAME
#
# Example, a 10-minute soak (DEADLINE bounds the bench: the checkpoint, the server's start
# and 45 s after the soak fit in the 240 s beside its 600; the first call
# returns at once, the next ones wait):
#   bash scripts/gpu/detached.sh start soak env DEADLINE=840 TAG=soak \
#       BENCH_ARGS="--soak 10" bash scripts/gpu/vllm_bench.sh
#   bash scripts/gpu/detached.sh collect soak 540     # exit 3: still running
#   bash scripts/gpu/detached.sh collect soak 540     # the soak's verdict
set -uo pipefail
ROOT=${PLE_DETACHED_ROOT:-/tmp/ple-detached}
cmd=${1:-}
name=${2:-}
if [ -z "$cmd" ] || [ -z "$name" ]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
    exit 2
fi
case "$name" in
    */* | .* ) echo "detached.sh: NAME must be a plain name, got '$name'" >&2; exit 2 ;;
esac
dir=$ROOT/$name
running() { [ -f "$dir/pid" ] && [ ! -f "$dir/rc" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; }
case "$cmd" in
    start)
        shift 2
        [ $# -gt 0 ] || { echo "detached.sh start: no command given" >&2; exit 2; }
        if running; then
            echo "detached.sh: $name is already running (pid $(cat "$dir/pid"))" >&2
            exit 2
        fi
        if [ ! -f scripts/gpu/detached.sh ]; then
            echo "detached.sh start: run it from the repository root" >&2
            exit 2
        fi
        rm -rf "$dir" && mkdir -p "$dir/out" "$dir/src" || exit 2
        # It runs in a copy of the repository (.git, .vllm-bundle and dist/ left out: the
        # scripts read vLLM and the wheel from /tmp): the next call copies the working tree
        # here again, under a script bash still reads. Other carried dot-folders (e.g.
        # .gemma3n-wheels) come along.
        shopt -s nullglob dotglob
        for f in *; do
            case "$f" in .git | .vllm-bundle | dist) continue ;; esac
            cp -r "$f" "$dir/src/" || exit 2
        done
        shopt -u dotglob
        # The status file is written by the new session itself, so it is there however
        # the command ends; the command's own $OUT is the folder that survives the call.
        # The session's shell writes its own pid (setsid may fork, so $! would not be it).
        (cd "$dir/src" && OUT=$dir/out exec setsid bash -c \
            'echo $$ >"$0/pid"; "$@" >"$0/log" 2>&1 </dev/null; echo $? >"$0/rc"' \
            "$dir" "$@" </dev/null >/dev/null 2>&1) &
        for _ in $(seq 50); do [ -f "$dir/pid" ] && break; sleep 0.1; done
        if [ ! -f "$dir/pid" ]; then
            echo "detached.sh: $name did not start" >&2
            exit 2
        fi
        echo "detached.sh: $name started (pid $(cat "$dir/pid")), outputs in $dir/out"
        ;;
    status)
        if [ ! -d "$dir" ]; then echo "$name: never started"; exit 2; fi
        if [ -f "$dir/rc" ]; then echo "$name: ended, exit $(cat "$dir/rc")"; exit 0; fi
        if running; then echo "$name: running"; exit 3; fi
        echo "$name: gone without a status (the machine was given back?)"; exit 2
        ;;
    collect)
        wait_s=${3:-540}
        [ -d "$dir" ] || { echo "detached.sh: $name was never started here" >&2; exit 2; }
        : "${OUT:?set OUT to the folder that comes back}"
        end=$((SECONDS + wait_s))
        while [ ! -f "$dir/rc" ] && running && [ $SECONDS -lt "$end" ]; do
            sleep 2
        done
        mkdir -p "$OUT"
        cp -r "$dir/out/." "$OUT/" 2>/dev/null
        cp "$dir/log" "$OUT/$name.log" 2>/dev/null
        tail -n 60 "$dir/log" 2>/dev/null
        if [ -f "$dir/rc" ]; then
            rc=$(cat "$dir/rc")
            echo "detached.sh: $name ended, exit $rc"
            exit "$rc"
        fi
        if running; then
            echo "detached.sh: $name still running after ${wait_s} s (outputs so far copied)"
            exit 3
        fi
        echo "detached.sh: $name ended without a status (killed?)" >&2
        exit 2
        ;;
    *)
        echo "detached.sh: unknown command '$cmd' (start, collect, status)" >&2
        exit 2
        ;;
esac
