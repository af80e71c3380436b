"""ple-memops in vLLM: Qwen4Exp PLE tables memory-mapped from the checkpoint and consumed
by FULL CUDA graphs that wait for rows the host gathers after launch.

``python -m ple_memops.vllm apply`` patches an installed vLLM 0.33.0; the switch is
``--engram-config '{"table_backend": "mmap"}'`` (or ``PLE_MEMOPS_TABLE_BACKEND=mmap``).

Nothing here imports vLLM: :mod:`.hooks` (the runner protocol), :mod:`.ngram` (the
Qwen4Exp row ids in torch), :mod:`.tables` (finding a layer's table in a checkpoint) and
:mod:`.ops` (the custom ops) run without it; :mod:`.qwen4exp` and :mod:`.runner`'s load
hook are what the patched vLLM calls.
"""

from __future__ import annotations

from .hooks import DEPTH, PleRunnerHooks, deferrable
from .ngram import NGramHasher, NGramLayout
from .tables import TableSpec, checkpoint_tensor_names, find_layer_table, open_layer_table

__all__ = [
    "DEPTH",
    "NGramHasher",
    "NGramLayout",
    "PleRunnerHooks",
    "TableSpec",
    "checkpoint_tensor_names",
    "deferrable",
    "find_layer_table",
    "open_layer_table",
]
