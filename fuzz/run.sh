#!/usr/bin/env bash
# Build and run the open_checkpoint fuzz target with plain cargo (what cargo-fuzz does;
# RUSTC_BOOTSTRAP=1 lets the stable toolchain take -Zsanitizer=address).
# Usage: fuzz/run.sh [seconds]   (default 660)
set -euo pipefail
cd "$(dirname "$0")"
SECS=${1:-660}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
RUSTC_BOOTSTRAP=1 RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Zsanitizer=address \
-Cdebug-assertions -Coverflow-checks" \
  cargo build --release --target x86_64-unknown-linux-gnu --bin open_checkpoint
mkdir -p corpus/open_checkpoint artifacts
python3 make_seeds.py corpus/open_checkpoint
mkdir -p /dev/shm/ple-fuzz-tmp
FUZZ_TMP=/dev/shm/ple-fuzz-tmp "$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/open_checkpoint" \
  -max_total_time="$SECS" -max_len=8192 -timeout=10 -rss_limit_mb=2048 \
  -dict=open_checkpoint.dict -artifact_prefix=artifacts/ -print_final_stats=1 \
  corpus/open_checkpoint
