#!/usr/bin/env bash
# Every engine suite of one vLLM release on a GPU host, after that release's bundle was set
# up (scripts/vllm-h200/setup.sh: vLLM in /tmp/vllm-RELEASE) and our wheel installed in
# /tmp/site: the bundle's check.py (stock vLLM serves here), the Qwen4Exp engine tests
# (scripts/gpu/vllm_engine.sh; SERVE=1, the default, then `vllm serve` over HTTP), then the
# Gemma 4 and Gemma 3n engine tests (scripts/gpu/vllm_gemma4.sh; Gemma 3n needs
# /tmp/site-gemma3n or a carried .gemma3n-wheels/). One engine script at a time on a host:
# scripts/gpu/gpu_lock.sh makes a second one wait (vLLM's start-up memory profiling fails
# beside another engine).
# Logs end up in one archive,
# $OUT/RELEASE-logs.tgz, and the verdicts on stdout. Over 10 minutes: start it with
# scripts/gpu/detached.sh.
#   bash scripts/gpu/vllm_release_suites.sh RELEASE
set -uo pipefail
. "$(dirname "$0")/gpu_lock.sh" && gpu_lock vllm_release_suites.sh
REL=${1:?usage: vllm_release_suites.sh RELEASE}
export VLLM_SITE=/tmp/vllm-$REL
[ -f "$VLLM_SITE/vllm/__init__.py" ] || { echo "vLLM $REL is not set up in $VLLM_SITE"; exit 2; }
FINAL=${OUT:-/tmp/ple-out}
mkdir -p "$FINAL"
export OUT=/tmp/ple-logs/$REL
rm -rf "$OUT" && mkdir -p "$OUT"
pack() { tar -C /tmp/ple-logs -czf "$FINAL/$REL-logs.tgz" "$REL"; }
trap pack EXIT
echo "== vLLM $REL: the bundle's check.py"
bundle_check=$(ls .vllm-bundle/"$REL"/*/check.py scripts/vllm-h200/check.py 2>/dev/null | head -1)
(cd /tmp && PYTHONPATH=$VLLM_SITE VLLM_USE_FLASHINFER_SAMPLER=0 timeout 400 \
    python3 "$OLDPWD/$bundle_check" >"$OUT/check.log" 2>&1)
c=$?
tail -2 "$OUT/check.log"
[ $c -eq 0 ] || { echo "== vLLM $REL does not serve here (check.py exit $c)"; tail -20 "$OUT/check.log"; exit 1; }
echo "== vLLM $REL: the Qwen4Exp engine tests"
ENGINE_LIMIT=${ENGINE_LIMIT:-900} SERVE=${SERVE:-1} bash scripts/gpu/vllm_engine.sh
e=$?
echo "== vLLM $REL: Gemma 4 and Gemma 3n"
ENGINE_LIMIT=${ENGINE_LIMIT:-900} GEMMA3N_LIMIT=${GEMMA3N_LIMIT:-600} SERVE=0 \
    bash scripts/gpu/vllm_gemma4.sh
g=$?
echo "== vLLM $REL: Qwen4Exp rc=$e, Gemma rc=$g"
[ $e -eq 0 ] && [ $g -eq 0 ]
