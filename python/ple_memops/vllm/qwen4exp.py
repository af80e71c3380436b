"""The mmap table backend of vLLM 0.33.0's NVIDIA Qwen4Exp PLE embedding.

Imported only by the patched vLLM (and its tests): it subclasses vLLM's
``Qwen4ExpPLEEmbedding``. The table is never allocated (a 0-row placeholder keeps the
parameter and its quantization scale); rows come from the checkpoint through the runner's
rows plan, staged one layer ahead by the model's existing prefetch calls:

* ``start_prefetch(ids)`` -> ``torch.ops.ple_memops.stage_rows``: under FULL capture
  the graph publishes the ids and waits for the host's fill on a side stream; eagerly
  the host gathers them before the consumer;
* ``finalize_prefetch(tokens)`` -> ``torch.ops.ple_memops.join_rows`` and the staging
  rows viewed as the table's dtype, ``[tokens, heads * head_dim]``.

Every tensor-parallel rank reads full rows (the page cache is shared), so the vocabulary
split and its all-reduce are skipped.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.models.qwen4_exp.common.ngram_embedding import (
    Qwen4ExpPLEEmbedding,
    Qwen4ExpPLEEmbeddingMethod,
    Qwen4ExpPLENvFp4EmbeddingMethod,
)

from ..errors import StateError, UnsupportedError
from . import ops
from .hooks import PleRunnerHooks
from .tables import TABLE_DTYPES

__all__ = ["Qwen4ExpPLEMmapEmbedding", "find_mmap_embeddings"]


class Qwen4ExpPLEMmapEmbedding(Qwen4ExpPLEEmbedding):
    """A PLE table served from the checkpoint's memory map (see the module)."""

    supports_prefetch: ClassVar[bool] = True

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        params_dtype: torch.dtype,
        padding_size: int,
        prefix: str,
        embedding_method: Qwen4ExpPLEEmbeddingMethod,
        num_ngram_heads: int = 1,
        max_total_tokens: int = 0,
        data_parallel_rank: int = 0,
        reduce_results: bool = True,
    ) -> None:
        if isinstance(embedding_method, Qwen4ExpPLENvFp4EmbeddingMethod):
            raise UnsupportedError(
                f"ple-memops mmap PLE tables: {prefix} is NVFP4 (packed rows plus per-block "
                "scales in a second table); only FP8 and BF16/F16/F32 tables are served. Use "
                '--engram-config \'{"table_backend": "default"}\' for this checkpoint'
            )
        super().__init__(
            num_embeddings,
            embedding_dim,
            params_dtype=params_dtype,
            padding_size=padding_size,
            prefix=prefix,
            embedding_method=embedding_method,
            num_ngram_heads=num_ngram_heads,
            max_total_tokens=max_total_tokens,
            data_parallel_rank=data_parallel_rank,
            reduce_results=reduce_results,
        )
        if self.etp_data_parallel_size != 1:
            raise UnsupportedError(
                "ple-memops mmap PLE tables: the embedding is shared across data-parallel "
                "ranks (embedding_across_dp); every rank reads full rows itself, so turn it off"
            )
        self.ple_memops_name = prefix
        self.ple_memops_heads = int(num_ngram_heads)
        self.ple_memops_hooks: PleRunnerHooks | None = None

    @property
    def table_dtype(self) -> str:
        """The safetensors dtype the checkpoint's table must have."""
        return TABLE_DTYPES[str(self.weight.dtype)]

    @property
    def row_bytes(self) -> int:
        return int(self.embedding_dim) * int(self.weight.element_size())

    def allocate_embedding_weight(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """A 0-row placeholder: the table stays in the checkpoint's files."""
        del num_embeddings
        return torch.empty((0, embedding_dim), dtype=dtype)

    def _hooks(self) -> PleRunnerHooks:
        hooks = self.ple_memops_hooks
        if hooks is None:
            raise StateError(
                f"ple-memops: the mmap PLE table {self.ple_memops_name} has no rows plan; "
                "Model Runner V2's load_model attaches it (is the ple-memops patch applied, "
                "and Model Runner V2 in use?)"
            )
        return hooks

    def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
        """Stage the rows of ``ngram_ids`` (``int64 [tokens, heads]``)."""
        out = self._hooks().output(self.ple_memops_name, ngram_ids.shape[0])
        ops.stage_rows(ngram_ids, out, self.ple_memops_name)

    def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
        """The staged rows, ready for the consumer: ``[tokens, heads * head_dim]`` in the
        table's dtype (dequantised by the embedding method as usual)."""
        out = self._hooks().output(self.ple_memops_name, total_tokens)
        ops.join_rows(out, self.ple_memops_name)
        rows: torch.Tensor = out.view(self.weight.dtype)
        return rows.view(total_tokens, self.ple_memops_heads * int(self.embedding_dim))

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "mmap PLE embedding: rows are staged by start_prefetch() and read by "
            "finalize_prefetch()"
        )


def find_mmap_embeddings(model: torch.nn.Module) -> list[Qwen4ExpPLEMmapEmbedding]:
    """The model's mmap PLE tables, in module order."""
    return [m for m in model.modules() if isinstance(m, Qwen4ExpPLEMmapEmbedding)]


def layer_weight_scale(module: Any) -> float | None:
    """The FP8 scale vLLM loaded for ``module`` (``None`` when unquantised)."""
    scale = getattr(module, "weight_scale", None)
    if scale is None or scale.numel() != 1:
        return None
    return float(scale.detach().float().cpu().item())
