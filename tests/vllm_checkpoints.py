"""The tiny Qwen4Exp and Gemma 4 checkpoints of the vLLM tests. They live in
``benchmarks/vllm_harness.py`` (the benchmarks' diagnostic writes them too); the tests
import them from here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from vllm_harness import (
    CONFIG,
    GEMMA4_CONFIG,
    HEAD_DIM,
    HEADS,
    PLE_LAYERS,
    write_checkpoint,
    write_gemma4_checkpoint,
)

__all__ = [
    "CONFIG",
    "GEMMA4_CONFIG",
    "HEADS",
    "HEAD_DIM",
    "PLE_LAYERS",
    "write_checkpoint",
    "write_gemma4_checkpoint",
]
