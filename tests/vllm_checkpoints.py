"""The tiny Qwen4Exp checkpoints of the vLLM tests. They live in
``benchmarks/vllm_harness.py`` (the benchmarks' diagnostic writes them too); the tests
import them from here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from vllm_harness import CONFIG, HEAD_DIM, HEADS, PLE_LAYERS, write_checkpoint

__all__ = ["CONFIG", "HEADS", "HEAD_DIM", "PLE_LAYERS", "write_checkpoint"]
