#!/usr/bin/env bash
# The two wheels transformers' Gemma 3n needs on the H200 and the vLLM bundle leaves out:
# timm (its vision tower) and the torchvision that pairs with the image's torch 2.11
# (timm imports it). Run here, with PyPI, from the repository root; they land in
# .gemma3n-wheels/ (10 MB, ignored by git): carry it with the bundle's last part, and
# scripts/gpu/vllm_gemma4.sh installs them apart (/tmp/site-gemma3n) for the Gemma 3n
# engine test only, so a wheel that does not load there cannot affect the other tests.
set -euo pipefail
DEST=${1:-.gemma3n-wheels}
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d "$DEST" \
    "torchvision==0.26.0" "timm==1.0.31"
ls -l "$DEST"
