"""The tiny Qwen4Exp, Gemma 4 and Gemma 3n checkpoints of the vLLM tests (and the Gemma 4 engine
tests' workload). They live in
``tests/vllm_harness.py`` (the benchmarks' diagnostic writes them too); the tests
import them from here. ``benchmarks/`` is on the path through pytest's ``pythonpath``; a
script that imports this module puts it there itself."""

from __future__ import annotations

from vllm_harness import (
    CONFIG,
    ENGINE_MAX_TOKENS,
    GEMMA3N_CONFIG,
    GEMMA4_CONFIG,
    GEMMA4_TABLE,
    HEAD_DIM,
    HEADS,
    NEAR_TIE,
    PLE_LAYERS,
    check_greedy_oracle,
    copy_without_table,
    gemma4_engine_workload,
    write_checkpoint,
    write_gemma3n_checkpoint,
    write_gemma4_checkpoint,
)

__all__ = [
    "CONFIG",
    "ENGINE_MAX_TOKENS",
    "GEMMA3N_CONFIG",
    "GEMMA4_CONFIG",
    "GEMMA4_TABLE",
    "HEADS",
    "HEAD_DIM",
    "NEAR_TIE",
    "PLE_LAYERS",
    "check_greedy_oracle",
    "copy_without_table",
    "gemma4_engine_workload",
    "write_checkpoint",
    "write_gemma3n_checkpoint",
    "write_gemma4_checkpoint",
]
