#!/usr/bin/env bash
# Cold tables on an H200: the table tests (GPU and CPU), the cold-gather
# benchmark against the storage floor on this host, Zipf hit rates under an RSS budget,
# and how much of a cold step's read the deferred path hides behind GPU work.
#
# Run from the repository root with the wheel installed and PYTHONPATH set (README, "GPU
# machine"). Writes two files: $OUT/table.log (everything printed) and $OUT/table.json
# (the benchmarks' numbers). Expected wall time: about 2 minutes (budget 2.5).
set -uo pipefail
OUT=${OUT:-/tmp/ple-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
R=$PWD
LOG="$OUT/table.log"
: >"$LOG"
# The table file must live on the machine's disk (a tmpfs would read without I/O).
D=${COLD_DIR:-/var/tmp/ple-cold}
mkdir -p "$D"
if [ "$(findmnt -no FSTYPE -T "$D" 2>/dev/null)" = tmpfs ]; then
    D="$R/.ple-cold"
    mkdir -p "$D"
fi
GIB=${COLD_GIB:-2.5}
J=$(mktemp -d)
step() { echo "== $* ($(date +%T))" | tee -a "$LOG"; }

step "host"
{
    uname -r
    nproc
    free -g | head -2
    findmnt -no SOURCE,FSTYPE,OPTIONS -T "$D"
    lsblk -d -o NAME,ROTA,SIZE,MODEL 2>/dev/null
    echo "io_uring_disabled=$(cat /proc/sys/kernel/io_uring_disabled 2>/dev/null || echo n/a)"
    echo "fio: $(command -v fio || echo 'not installed (the package probe measures the floor)')"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
} 2>&1 | tee -a "$LOG"

step "pytest: table tests (GPU and CPU)"
T=""
python3 -c "import pytest_timeout" 2>/dev/null && T="--timeout=120"
(cd /tmp && timeout 60 python3 -m pytest "$R/tests/test_table_cold_gpu.py" \
    "$R/tests/test_table_cold.py" "$R/tests/test_table.py" -q -rs -s $T -p no:cacheprovider 2>&1) \
    >>"$LOG"
echo "pytest exit $?" | tee -a "$LOG"
grep -E "passed|failed|error|cgroup" "$LOG" | tail -5

step "bench_cold host (floor, cold and warm gathers, Zipf under a budget)"
timeout 95 python3 "$R/benchmarks/bench_cold.py" host --dir "$D" --gib "$GIB" --keep --quick \
    --zipf --zipf-steps 300 --zipf-budget-mib 16 64 --json "$J/host.json" 2>&1 | tee -a "$LOG" \
    | grep -vE "^ +(16|256|1024) +(pool|fault|old)" | tail -42

step "bench_cold overlap (evicted table, GPU work before the consumer)"
timeout 60 python3 "$R/benchmarks/bench_cold.py" overlap --dir "$D" --gib "$GIB" --keep \
    --steps 20 --json "$J/overlap.json" 2>&1 | tee -a "$LOG" | tail -22

python3 - "$J" "$OUT/table.json" <<'EOF'
import json, os, sys
j, out = sys.argv[1], sys.argv[2]
res = {}
for name in ("host", "overlap"):
    p = os.path.join(j, name + ".json")
    if os.path.exists(p):
        with open(p) as f:
            res[name] = json.load(f)
with open(out, "w") as f:
    json.dump(res, f, indent=1)
print("results:", ", ".join(res) or "none", "->", out)
EOF
rm -rf "$D" "$J"
step "done"
