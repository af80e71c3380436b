"""What the runner needs of a model's mmap PLE table module, whatever the model.

Each model integration (:mod:`.qwen4exp`, :mod:`.gemma4`) builds its model with a table
class of its own that mixes in :class:`MmapTableLayer`: the module keeps the table's
shape and dtype (a 0-row placeholder weight, never allocated), registers itself under
its name where the custom ops of :mod:`.ops` look layers up, and answers the runner's
questions below. The runner (:func:`ple_memops.vllm.runner.attach_runner`) finds every
such module, opens each table in the checkpoint, builds the tables' ``Steps`` and binds them.

A leaf module: no torch, no vLLM.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from .tables import LayerTable

__all__ = ["MmapTableLayer", "TableExpectations", "find_tables"]


@dataclass(frozen=True)
class TableExpectations:
    """What the checkpoint's table must be for the model: checked when it is opened."""

    rows: int
    row_bytes: int
    dtype: str
    scale: float | None = None


class MmapTableLayer(ABC):
    """The runner's view of one mmap PLE table module (a mixin of the model's table class;
    a class that leaves an abstract method out cannot be built).

    Attributes:
        ple_memops_name: the module's name in the model (the ops' layer name).
        ple_memops_heads: row ids per token (Qwen4Exp: its n-gram heads; Gemma: 1).
        ple_memops_hooks: the runner hooks bound at load time (``None`` before and after).
        ple_memops_ids_source: whether the model gives synchronous tables' FULL graphs an
            ids source (:meth:`~ple_memops.vllm.hooks.PleRunnerHooks.note_ids_source`);
            when not, tables that cannot defer runs without CUDA graphs.
        ple_memops_lead_threads: whether this table may take ``first_layer_threads`` (they
            go to the earliest-waited table that does): ``False`` for a table whose fill
            is too small to need them (a split Gemma row's first slice).
        ple_memops_own_threads: the gather threads of its own this table takes when it
            is the one that gets ``first_layer_threads`` and that setting is unset
            (``None``, the default: the shared pool; a split Gemma row's rest: 8).
        ple_memops_staged_first: whether the model stages every table's rows of a step
            before it joins any (all at the top of the forward): its tables may then read
            from storage in layer order (the ``read_in_order`` setting), which is for such
            models only.
    """

    ple_memops_name: str
    ple_memops_heads: int
    ple_memops_hooks: Any = None
    ple_memops_ids_source: ClassVar[bool] = False
    ple_memops_lead_threads: bool = True
    ple_memops_own_threads: int | None = None
    ple_memops_staged_first: ClassVar[bool] = False

    @abstractmethod
    def ple_memops_layer_index(self) -> int:
        """The first decoder layer whose consumer waits for this table's rows (the
        earliest gets ``first_layer_threads``)."""

    @abstractmethod
    def ple_memops_table(self, names: Iterable[str]) -> LayerTable:
        """Where this table is among the checkpoint's tensor ``names``."""

    @abstractmethod
    def ple_memops_expect(self) -> TableExpectations:
        """What the table must be (rows, bytes a row, dtype, scale) for this model."""

    def ple_memops_bind(self, hooks: Any, max_tokens: int) -> None:
        """Bind the runner hooks (``None`` unbinds) for steps of up to ``max_tokens``."""
        self.ple_memops_hooks = hooks


def find_tables(model: Any) -> list[Any]:
    """The model's mmap PLE table modules (``model.modules()`` order)."""
    return [m for m in model.modules() if isinstance(m, MmapTableLayer)]
