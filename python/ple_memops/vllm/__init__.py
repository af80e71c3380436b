"""ple-memops in vLLM: the per-layer embedding tables of Qwen4Exp, Gemma 4 and Gemma 3n
memory-mapped from the checkpoint and consumed by FULL CUDA graphs that wait for rows the
host gathers after launch.

A vLLM general plugin (:mod:`.plugin`, entry point ``ple_memops``): ``pip install
ple-memops`` is the whole install, and ``PLE_MEMOPS_TABLE_BACKEND=mmap`` switches it on
(:mod:`.settings`). ``python -m ple_memops.vllm check`` says whether vLLM discovers it,
whether it is on, and whether the installed vLLM is one it was tested with.

Nothing imported here needs vLLM: :mod:`.settings`, :mod:`.hooks` (the runner protocol),
:mod:`.tables` (finding a layer's table in a checkpoint) and :mod:`.ops` (the custom
ops); :mod:`.qwen4exp`, :mod:`.gemma4`, :mod:`.gemma3n` and :mod:`.runner` subclass
vLLM's classes and are imported by the plugin once it is on.
"""

from __future__ import annotations

from .hooks import PleRunnerHooks, deferrable
from .settings import DEPTH, Settings
from .tables import LayerTable, checkpoint_tensor_names, find_layer_table, open_layer_table

__all__ = [
    "DEPTH",
    "LayerTable",
    "PleRunnerHooks",
    "Settings",
    "checkpoint_tensor_names",
    "deferrable",
    "find_layer_table",
    "open_layer_table",
]
