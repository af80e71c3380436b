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
    "transformers>=5.17" "matplotlib>=3.7"

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

echo "== vLLM (CPU), each supported release in its own environment: the wheel installed as a vLLM"
echo "   plugin, no other step; vLLM's files as released"
# vLLM pins its own torch, so each release gets an environment of its own (about 9.5 GB each;
# pip's cache serves reruns). They live in PLE_MEMOPS_VLLM_ENVS (default ~/.cache/ple-memops),
# shared by every clone on the machine; PLE_MEMOPS_VLLM_RELEASES picks releases (default both).
ENVS=${PLE_MEMOPS_VLLM_ENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/ple-memops}
RELEASES=${PLE_MEMOPS_VLLM_RELEASES:-0.33.0 0.34.0}
export VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES=  # see tests/test_vllm_real.py
for release in $RELEASES; do
    VENV=$ENVS/vllm-$release
    echo "-- vLLM $release: $VENV"
    if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; \
sys.exit(m.version('vllm') != '$release')" >/dev/null 2>&1; then
        echo "   building it: vLLM $release and its own torch, about 9.5 GB; several minutes (5-10"
        echo "   on a fresh 2-core machine; pip's lines below show its progress); later runs reuse it"
        rm -rf "$VENV" && mkdir -p "$ENVS"
        $PY -m venv "$VENV"
        bash scripts/vllm_env.sh "$VENV/bin/python" "$release"
        echo "   vLLM $release environment ready"
    fi
    echo "   installing pytest, timm (transformers' Gemma 3n vision tower) and the wheel into it"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "pytest>=8" "timm>=1.0,<2"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
        dist/*.whl
    echo "   the plugin's tests against the released vLLM $release, on the CPU"
    (cd /tmp && "$VENV/bin/python" -m pytest "$OLDPWD/tests/test_vllm_real.py" \
        "$OLDPWD/tests/test_vllm_gemma4_real.py" "$OLDPWD/tests/test_vllm_gemma3n_real.py" \
        -q -p no:cacheprovider)
done
