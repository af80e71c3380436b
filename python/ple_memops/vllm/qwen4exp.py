"""vLLM's NVIDIA Qwen4Exp with its n-gram PLE tables served from the checkpoint.

Imported only once the plugin is switched on (it subclasses vLLM's classes):

* :class:`Qwen4ExpPLEMmapEmbedding`, the table class: never allocated (a 0-row
  placeholder keeps the parameter and its FP8 scale), rows staged by the runner's steps
  through the custom ops of :mod:`ple_memops.vllm.ops`, every tensor-parallel rank
  reading full rows (the page cache is shared), so no vocabulary split or all-reduce;
* :class:`Qwen4ExpMmapForCausalLM` and :class:`Qwen4ExpMmapForConditionalGeneration`,
  registered under vLLM's own architecture names: for an engine whose settings say
  ``mmap`` they build the model with that table class, stage every PLE layer's rows at
  the top of the forward (each host gather then overlaps all the GPU work before its
  consumer) and tell vLLM's loader that files holding only table rows need not be read;
  for any other engine they are vLLM's classes unchanged;
* :func:`verify_and_update_config`, the refusals at config time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from vllm.models.qwen4_exp.common.ngram_embedding import (
    Qwen4ExpPLEEmbedding,
    Qwen4ExpPLEEmbeddingMethod,
    Qwen4ExpPLENvFp4EmbeddingMethod,
)
from vllm.models.qwen4_exp.nvidia import ngram_embedding as nvidia_ngram
from vllm.models.qwen4_exp.nvidia.model import (
    Qwen4ExpForCausalLM,
    Qwen4ExpForConditionalGeneration,
)

from ..errors import StateError, UnsupportedError
from . import ops
from .layer import MmapTableLayer, TableExpectations, find_tables
from .settings import (
    BACKEND_ENV,
    CONFIG_KEY,
    engine_settings,
    parallel_refusals,
    raise_refusals,
)
from .tables import TABLE_DTYPES, LayerTable, find_layer_table, is_table_weight

__all__ = [
    "ARCHITECTURES",
    "Qwen4ExpMmapForCausalLM",
    "Qwen4ExpMmapForConditionalGeneration",
    "Qwen4ExpPLEMmapEmbedding",
    "find_mmap_embeddings",
    "layer_weight_scale",
    "verify_and_update_config",
]

logger = logging.getLogger("ple_memops")

_TABLE_CLASSES = ("Qwen4ExpPLEDeviceEmbedding", "Qwen4ExpPLEPinnedHostEmbedding")
_LAYER = re.compile(r"layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding$")
_BREAKABLE = "VLLM_USE_BREAKABLE_CUDAGRAPH"
# What the user asked for, read when the plugin installs (before vLLM's config can set it).
_USER_BREAKABLE = os.environ.get(_BREAKABLE)


class Qwen4ExpPLEMmapEmbedding(Qwen4ExpPLEEmbedding, MmapTableLayer):
    """A PLE table served from the checkpoint's memory map (see the module)."""

    supports_prefetch: ClassVar[bool] = True
    # `_note_ids_source` gives synchronous tables' FULL graphs vLLM's own id computation.
    ple_memops_ids_source: ClassVar[bool] = True
    # `_stage_all_at_top` stages every PLE layer before decoder layer 0.
    ple_memops_staged_first: ClassVar[bool] = True

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
                "scales in a second table); only FP8 and BF16/F16/F32 tables are served. "
                f"Serve this checkpoint without {BACKEND_ENV}=mmap (or with "
                f'additional_config {{"{CONFIG_KEY}": {{"table_backend": "default"}}}})'
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
        self.ple_memops_hooks: Any = None
        # The rows never come through the loader: a shard or the whole table arriving
        # from a file that also holds other weights is checked and dropped.
        self.weight.weight_loader = self._drop_rows
        # The custom ops find the layer through vLLM's forward context, like attention.
        from vllm.config import get_current_vllm_config

        layers = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in layers:
            raise ValueError(f"Duplicate layer name: {prefix}")
        layers[prefix] = self

    def _drop_rows(self, param: torch.Tensor, loaded: torch.Tensor, **_: Any) -> None:
        if loaded.dim() != 2 or loaded.shape[1] != self.embedding_dim:
            raise ValueError(
                f"{self.ple_memops_name}: a table tensor of shape {tuple(loaded.shape)}, "
                f"rows of {self.embedding_dim} expected"
            )

    @property
    def table_dtype(self) -> str:
        """The safetensors dtype the checkpoint's table must have."""
        return TABLE_DTYPES[str(self.weight.dtype)]

    @property
    def row_bytes(self) -> int:
        return int(self.embedding_dim) * int(self.weight.element_size())

    def ple_memops_layer_index(self) -> int:
        match = _LAYER.search(self.ple_memops_name)
        if match is None:
            raise UnsupportedError(f"cannot tell the decoder layer of {self.ple_memops_name}")
        return int(match.group(1))

    def ple_memops_table(self, names: Iterable[str]) -> LayerTable:
        return find_layer_table(names, self.ple_memops_layer_index())

    def ple_memops_expect(self) -> TableExpectations:
        return TableExpectations(
            rows=int(self.org_vocab_size),
            row_bytes=self.row_bytes,
            dtype=self.table_dtype,
            scale=layer_weight_scale(self),
        )

    def allocate_embedding_weight(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """A 0-row placeholder: the table stays in the checkpoint's files."""
        del num_embeddings
        return torch.empty((0, embedding_dim), dtype=dtype)

    def hooks(self) -> Any:
        hooks = self.ple_memops_hooks
        if hooks is None:
            raise StateError(
                f"ple-memops: the mmap PLE table {self.ple_memops_name} has no steps; "
                "only the plugin's worker attaches one at load time, on a CUDA device "
                "(a CPU engine keeps vLLM's runner, and an engine whose worker_cls names "
                "another worker is refused; `python -m ple_memops.vllm check` tells "
                "whether the plugin is on)"
            )
        return hooks

    def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
        """Stage the rows of ``ngram_ids`` (``int64 [tokens, heads]``)."""
        out = self.hooks().output(self.ple_memops_name, ngram_ids.shape[0])
        ops.stage_rows(ngram_ids, out, self.ple_memops_name)

    def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
        """The staged rows, ready for the consumer: ``[tokens, heads * head_dim]`` in the
        table's dtype (dequantised by the embedding method as usual)."""
        out = self.hooks().output(self.ple_memops_name, total_tokens)
        ops.join_rows(out, self.ple_memops_name)
        rows: torch.Tensor = out.view(self.weight.dtype)
        return rows.view(total_tokens, self.ple_memops_heads * int(self.embedding_dim))

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "mmap PLE embedding: rows are staged by start_prefetch() and read by "
            "finalize_prefetch()"
        )


@contextlib.contextmanager
def _mmap_table_class() -> Iterator[None]:
    """While a model is built, the NVIDIA n-gram embedding picks the mmap table class
    (it chooses between two module-level names by ``cpu_offload``)."""
    saved = {name: getattr(nvidia_ngram, name) for name in _TABLE_CLASSES}
    try:
        for name in _TABLE_CLASSES:
            setattr(nvidia_ngram, name, Qwen4ExpPLEMmapEmbedding)
        yield
    finally:
        for name, cls in saved.items():
            setattr(nvidia_ngram, name, cls)


def _stage_all_at_top(model: Any) -> None:
    """Replace the model's one-layer-ahead PLE prefetch by one that stages every PLE
    layer when the forward starts the first one (``Qwen4ExpModel.forward`` calls it for
    its first layer before the loop, then for each next layer inside it)."""
    layers = model.layers
    first = layers[model.start_layer] if model.start_layer < model.end_layer else None
    later = [layers[i] for i in range(model.start_layer + 1, model.end_layer)]
    original = type(model)._start_layer_ple_prefetch

    def start(
        layer: torch.nn.Module,
        input_ids: torch.Tensor | None,
        query_start_loc: torch.Tensor | None,
        ngram_context: torch.Tensor | None,
    ) -> None:
        if layer is not first:
            return  # staged with the first
        if input_ids is not None and input_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            # Synchronous tables' FULL graph computes its ids before each replay too.
            assert query_start_loc is not None and ngram_context is not None
            _note_ids_source([first, *later], input_ids, query_start_loc, ngram_context)
        original(layer, input_ids, query_start_loc, ngram_context)
        for other in later:
            original(other, input_ids, query_start_loc, ngram_context)

    model._start_layer_ple_prefetch = start


def _note_ids_source(
    layers: list[Any],
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
) -> None:
    """Give the rows hooks, under capture, what recomputes every PLE layer's ids from this
    capture's (graph-static) inputs into the buffers its PLE ops stage: vLLM's own
    ``compute_ngram_ids`` into each layer's ``_prefetch_ids``, as its ``start_prefetch``
    does."""
    embeddings = [layer.ple.ple_embedding for layer in layers if getattr(layer, "ple", None)]
    if not embeddings:
        return
    hooks = getattr(embeddings[0].ngram_embedding, "ple_memops_hooks", None)
    if hooks is None:
        return
    n = input_ids.numel()

    def recompute() -> None:
        for e in embeddings:
            e.compute_ngram_ids(
                input_ids, query_start_loc, ngram_context, output=e._prefetch_ids[:n]
            )

    hooks.note_ids_source(recompute)


def _finish_mmap_model(language_model: Any) -> int:
    """What the mmap tables change after the model is built; returns how many."""
    tables = 0
    module: Any
    for module in language_model.modules():
        if isinstance(getattr(module, "ngram_embedding", None), Qwen4ExpPLEMmapEmbedding):
            # Every rank holds full rows: nothing to reduce-scatter over the vocabulary.
            module.use_reduce_scatter = False
            tables += 1
    _stage_all_at_top(language_model.model)
    return tables


class Qwen4ExpMmapForCausalLM(Qwen4ExpForCausalLM):
    """vLLM's NVIDIA ``Qwen4ExpForCausalLM``; with ``mmap`` settings, its PLE tables stay
    in the checkpoint (see the module)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        mmap = engine_settings(vllm_config).mmap
        with _mmap_table_class() if mmap else contextlib.nullcontext():
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        if mmap and _finish_mmap_model(self):
            self.is_unused_checkpoint_weight = is_table_weight


class Qwen4ExpMmapForConditionalGeneration(Qwen4ExpForConditionalGeneration):
    """vLLM's NVIDIA ``Qwen4ExpForConditionalGeneration``, as above."""

    def __init__(self, *, vllm_config: Any, prefix: str = "model") -> None:
        mmap = engine_settings(vllm_config).mmap
        with _mmap_table_class() if mmap else contextlib.nullcontext():
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        if mmap and _finish_mmap_model(self.language_model):
            self.is_unused_checkpoint_weight = is_table_weight


ARCHITECTURES = {
    "Qwen4ExpForCausalLM": Qwen4ExpMmapForCausalLM,
    "Qwen4ExpForConditionalGeneration": Qwen4ExpMmapForConditionalGeneration,
}


def verify_and_update_config(vllm_config: Any) -> None:
    """The config-time refusals of an engine whose settings say ``mmap`` (called after
    vLLM's own Qwen4Exp hook): a clear error before any weight is read."""
    settings = engine_settings(vllm_config)
    if not settings.mmap:
        return
    refused = parallel_refusals(vllm_config)
    engram = vllm_config.engram_config
    if engram is not None and engram.embedding_across_dp:
        refused.append("embedding_across_dp=True (each rank reads full rows itself)")
    if engram is not None and engram.dp_shared_memory:
        refused.append("dp_shared_memory=True (there is no pinned table to share)")
    if engram is not None and getattr(engram, "disk_offload", False):
        # vLLM 0.34.0's own reader of the checkpoint's rows: two backends for one table.
        refused.append(
            "engram_config.disk_offload=True (vLLM's own disk offload of the same tables; "
            "serve them with one of the two: unset disk_offload, or the mmap backend)"
        )
    from vllm.platforms import current_platform

    if current_platform.is_rocm():
        refused.append("ROCm (the AMD Qwen4Exp model is not served)")
    if _USER_BREAKABLE == "1":
        refused.append(
            f"breakable CUDA graphs ({_BREAKABLE}=1): a PIECEWISE piece cannot wait for "
            "rows gathered after its launch, and a host gather cannot be captured; unset it "
            "(FULL decode graphs are used instead)"
        )
    elif os.environ.get(_BREAKABLE) != "0" and not refused:
        # vLLM 0.33.0 turns breakable graphs on by default for Qwen4Exp (right after this
        # hook, unless the variable is set; an earlier engine in this process may have set
        # it): opt out the way its own message says, so the NVIDIA model, which is not
        # torch-compiled, gets FULL decode graphs.
        os.environ[_BREAKABLE] = "0"
        logger.info(
            "ple-memops: %s=0 (mmap PLE tables need FULL CUDA graphs, not breakable "
            "PIECEWISE ones)",
            _BREAKABLE,
        )
    raise_refusals(refused)
    if engram is None:
        # vLLM makes a default one right after this hook; sharing a pinned table between
        # data-parallel replicas has nothing to share here.
        from vllm.config.engram import EngramConfig

        vllm_config.engram_config = EngramConfig(dp_shared_memory=False)
    else:
        engram.dp_shared_memory = False


def find_mmap_embeddings(model: torch.nn.Module) -> list[Qwen4ExpPLEMmapEmbedding]:
    """The model's mmap Qwen4Exp PLE tables, in module order."""
    return [m for m in find_tables(model) if isinstance(m, Qwen4ExpPLEMmapEmbedding)]


def layer_weight_scale(module: Any) -> float | None:
    """The FP8 scale vLLM loaded for ``module`` (``None`` when unquantised)."""
    scale = getattr(module, "weight_scale", None)
    if scale is None or scale.numel() != 1:
        return None
    return float(scale.detach().float().cpu().item())
