#!/usr/bin/env bash
# Every check and test, in the order a failure is cheapest to find. Run from the repo root.
# GPU tests run where a CUDA device is present and are skipped with the reason elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

echo "== install test prerequisites (a first run downloads torch: minutes; pip's cache serves reruns)"
rustup component add rustfmt clippy >/dev/null 2>&1 || true
# torch from PyPI is a large CUDA build; it is used on the CPU here (tests of tensors as
# staging buffers and rows) and on the GPU where there is one.
$PY -m pip install -q --disable-pip-version-check "maturin>=1.8,<2" "pytest>=8" "ruff>=0.6" \
    "mypy>=1.10" "numpy>=1.24" "safetensors>=0.4" "torch>=2.4" "ziglang>=0.13" \
    "transformers>=5.17"

echo "== rust: fmt, clippy, tests"
cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
cargo clippy --all-targets --locked --features python -- -D warnings
cargo test --locked -q

echo "== build and install the wheel (manylinux_2_28, where vLLM 0.33.0's own wheel installs; minutes)"
# zig links against glibc 2.28 whatever this machine's glibc is; maturin audits the symbols.
rm -rf dist
$PY -m maturin build --release --locked --zig --compatibility manylinux_2_28 -o dist -q
wheel=$(ls dist/*.whl)
case "$wheel" in
    *-cp311-abi3-manylinux_2_28_x86_64.whl) echo "wheel: $wheel" ;;
    *) echo "wheel is not tagged cp311-abi3-manylinux_2_28_x86_64: $wheel"; exit 1 ;;
esac
$PY -m pip install -q --force-reinstall --no-deps dist/*.whl

echo "== python: ruff, mypy, stubtest"
$PY -m ruff check python tests benchmarks
$PY -m ruff format --check python tests benchmarks
$PY -m mypy
(cd /tmp && $PY -m mypy.stubtest ple_memops._native --mypy-config-file "$OLDPWD/pyproject.toml")

echo "== pytest"
(cd /tmp && $PY -m pytest "$OLDPWD/tests" -q -p no:cacheprovider "$@")

echo "== vLLM 0.33.0 (CPU): the wheel installed as a vLLM plugin, no other step; vLLM's files as released"
# A separate environment (vLLM pins its own torch; about 9 GB, pip's cache serves reruns).
# PLE_MEMOPS_VLLM_VENV points at an existing one instead of .venv-vllm/.
VENV=${PLE_MEMOPS_VLLM_VENV:-$PWD/.venv-vllm}
if ! "$VENV/bin/python" -c 'import importlib.metadata as m; assert m.version("vllm") == "0.33.0"' \
        >/dev/null 2>&1; then
    echo "-- building the vLLM environment $VENV: vLLM 0.33.0 and its own torch, about 9.5 GB;"
    echo "   this takes several minutes (about 5 on a fresh 2-core machine; pip's lines below"
    echo "   show its progress); later runs reuse it"
    $PY -m venv "$VENV"
    # pipefail: a failing pip fails the script (grep only thins its output).
    "$VENV/bin/python" -m pip install --progress-bar off --disable-pip-version-check "vllm==0.33.0" \
        | grep --line-buffered -E "^(Collecting|Installing|Successfully)"
    echo "-- vLLM environment ready: $VENV"
else
    echo "-- reusing the vLLM environment $VENV (vLLM 0.33.0 is there)"
fi
echo "-- installing pytest, timm (transformers' Gemma 3n vision tower) and the wheel into the vLLM environment"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "pytest>=8" "timm>=1.0,<2"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
    dist/*.whl
export VLLM_TARGET_DEVICE=cpu
echo "-- the plugin's tests against the released vLLM, on the CPU"
(cd /tmp && "$VENV/bin/python" -m pytest "$OLDPWD/tests/test_vllm_real.py" \
    "$OLDPWD/tests/test_vllm_gemma4_real.py" "$OLDPWD/tests/test_vllm_gemma3n_real.py" \
    -q -p no:cacheprovider)
