#!/usr/bin/env bash
# The vLLM integration's GPU tests on an H200 without vLLM installed:
# the runner hooks driven through Model Runner V2's sequence by the stand-in runner, and
# the integration's CPU tests for good measure. Run from the repository root with the
# wheel installed and PYTHONPATH set (README, "GPU machine"); logs go to $OUT.
# Wall time: about 40 s (budget 2 min; hard limit 110 s).
set -uo pipefail
OUT=${OUT:-/tmp/ple-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
R=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/vllm_env.txt"
python3 -c "import torch, ple_memops; print('torch', torch.__version__, 'ple_memops', \
ple_memops.__file__)" | tee -a "$OUT/vllm_env.txt"
start=$(date +%s)
(cd /tmp && timeout 110 python3 -m pytest "$R/tests/test_vllm_runner_gpu.py" \
    "$R/tests/test_vllm_integration.py" -v -rs -p no:cacheprovider \
    --junitxml="$OUT/vllm_junit.xml" 2>&1) >"$OUT/vllm_pytest.log"
rc=$?
echo "== vllm: pytest exit $rc in $(( $(date +%s) - start )) s (124 = hit the time limit)"
grep -E "::.* (PASSED|FAILED|ERROR|SKIPPED)" "$OUT/vllm_pytest.log" | sed 's/^.*tests\//  /'
if [ $rc -ne 0 ]; then
    echo "== failures (full log: vllm_pytest.log)"
    sed -n '/= FAILURES =/,$p' "$OUT/vllm_pytest.log" | grep -E "^(E |FAILED|___)" | head -60
fi
tail -1 "$OUT/vllm_pytest.log"
exit $rc
