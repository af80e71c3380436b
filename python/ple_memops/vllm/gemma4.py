"""vLLM 0.33.0's Gemma 4 with its per-layer embedding table served from the checkpoint.

Imported only once the plugin is switched on (it subclasses vLLM's classes).

Gemma 4's E-series keep one table for all decoder layers, ``embed_tokens_per_layer``
(``[vocab_size_per_layer_input, num_hidden_layers * hidden_size_per_layer_input]``, E2B:
262,144 rows of 35 x 256 BF16 values, 4.7 GB), looked up by token id (ids outside the
table read row 0), scaled by ``sqrt(hidden_size_per_layer_input)`` and combined with a
projection of the token embedding at the top of the forward::

    per_layer_inputs = (norm(proj(h0) * s) + rows * sqrt(d)) * 2**-0.5     # [T, L, d]

then each decoder layer reads its ``[T, d]`` slice at its end. vLLM keeps the table on
the GPU (a ``VocabParallelEmbedding``); with ``mmap`` settings it stays in the
checkpoint's files:

* :class:`Gemma4PLEMmapTable` replaces the table module while the model is built: a
  0-row placeholder (never allocated, the loader's rows dropped), registered under its
  name for the custom ops of :mod:`.ops`;
* the model's ``get_per_layer_inputs`` stages the rows of the (masked) ids with
  ``stage_ids`` instead of looking them up, and ``project_per_layer_inputs`` computes
  the projection first, then ``read_rows``, then the stock arithmetic on the rows, the
  same operations in the same order (compiled alike by Inductor: the functional ops of
  :mod:`.ops`, since vLLM compiles Gemma 4): the host gather overlaps the token
  embedding and the projection, and the tokens are the stock engine's;
* :class:`Gemma4MmapForCausalLM` and :class:`Gemma4MmapForConditionalGeneration`,
  registered under vLLM's own architecture names, build that for an engine whose
  settings say ``mmap`` and are vLLM's classes unchanged otherwise. The multimodal
  class computes the rows in ``embed_input_ids``, eagerly, outside the CUDA graph;
  here it only records the step's ids there (image and audio tokens read row 0, as
  vLLM's) and the rows are staged in the forward, inside the graph;
* :func:`verify_and_update_config`, the config-time refusals and the graph mode: the
  custom ops cannot sit inside a PIECEWISE graph, so ``FULL_AND_PIECEWISE`` becomes
  ``FULL_DECODE_ONLY`` (decodes replay FULL graphs that defer their rows; prefills and
  mixed batches run compiled, without graphs, and defer theirs too). Async scheduling
  stays as the engine asked.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from vllm.model_executor.models import gemma4 as vllm_gemma4
from vllm.model_executor.models.gemma4 import Gemma4ForCausalLM, Gemma4SelfDecoderLayers
from vllm.model_executor.models.gemma4_mm import Gemma4ForConditionalGeneration

from ..errors import UnsupportedError
from . import ops
from .layer import MmapTableLayer, TableExpectations, find_tables
from .settings import (
    engine_settings,
    parallel_refusals,
    raise_refusals,
)
from .tables import TABLE_DTYPES, LayerTable, find_per_layer_table, is_per_layer_table_weight

__all__ = [
    "ARCHITECTURES",
    "Gemma4MmapForCausalLM",
    "Gemma4MmapForConditionalGeneration",
    "Gemma4PLEMmapTable",
    "verify_and_update_config",
]

logger = logging.getLogger("ple_memops")

_TABLE_SUFFIX = "embed_tokens_per_layer"


class Gemma4PLEMmapTable(nn.Module, MmapTableLayer):
    """Gemma 4's per-layer embedding table served from the checkpoint's memory map (see
    the module). Built with ``VocabParallelEmbedding``'s arguments."""

    ple_memops_heads = 1

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        org_num_embeddings: int | None = None,
        padding_size: int = 64,
        quant_config: Any = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        del padding_size, quant_config  # full rows on every rank; the dtype is checked
        dtype = params_dtype or torch.get_default_dtype()
        self.dtype = dtype
        self.org_vocab_size = int(org_num_embeddings or num_embeddings)
        self.embedding_dim = int(embedding_dim)
        # The table's shape and dtype, nothing allocated (a buffer, not a parameter: the
        # loader expects no rows for it, and load_weights drops any that come).
        self.register_buffer("weight", torch.empty(0, embedding_dim, dtype=dtype), persistent=False)
        self.ple_memops_name = prefix
        self.ple_memops_hooks = None
        from vllm.config import get_current_vllm_config

        layers = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in layers:
            raise ValueError(f"Duplicate layer name: {prefix}")
        layers[prefix] = self

    @property
    def row_bytes(self) -> int:
        return self.embedding_dim * self.dtype.itemsize

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's loader hands the table here when its file also holds other weights
        (``AutoWeightsLoader`` defers to a module's own ``load_weights``): checked and
        dropped. A table in a file of its own is never read."""
        loaded = set()
        for name, tensor in weights:
            if name != "weight" or tensor.dim() != 2 or tensor.shape[1] != self.embedding_dim:
                raise ValueError(
                    f"{self.ple_memops_name}: checkpoint tensor {name!r} of shape "
                    f"{tuple(tensor.shape)}; a table with rows of {self.embedding_dim} expected"
                )
            loaded.add(name)
        return loaded

    # -- the runner's view (MmapTableLayer) ------------------------------------------------

    def ple_memops_layer_index(self) -> int:
        return 0  # every decoder layer reads its slice of one table: layer 0 waits first

    def ple_memops_table(self, names: Iterable[str]) -> LayerTable:
        return find_per_layer_table(names)

    def ple_memops_expect(self) -> TableExpectations:
        return TableExpectations(
            rows=self.org_vocab_size,
            row_bytes=self.row_bytes,
            dtype=TABLE_DTYPES[str(self.dtype)],
        )

    def ple_memops_bind(self, hooks: Any, max_tokens: int) -> None:
        self.ple_memops_hooks = hooks
        if hooks is not None:
            hooks.ids_buffer(self.ple_memops_name)  # now, outside any capture

    # -- the model's two calls ----------------------------------------------------------

    def stage(self, ids: torch.Tensor) -> torch.Tensor:
        """Stage the rows of ``ids`` (``[T]``, already masked into the table) with the
        functional ops of a compiled model; returns the token :meth:`join` takes."""
        return ops.stage_ids(ids, self.ple_memops_name)

    def join(self, staged: torch.Tensor) -> torch.Tensor:
        """The rows :meth:`stage` staged, ready: ``[T, embedding_dim]`` in the table's
        dtype."""
        return ops.read_rows(staged, self.row_bytes, self.ple_memops_name).view(self.dtype)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "mmap per-layer embedding: rows are staged by stage() and read after join()"
        )


class _MmapSelfDecoderLayers(Gemma4SelfDecoderLayers):
    """vLLM's ``Gemma4SelfDecoderLayers`` (which owns the PLE lookup and projection for
    ``Gemma4Model``) with the rows staged and joined around the projection (the class of
    the built module is switched; nothing else of it changes)."""

    def get_per_layer_inputs(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        table = self.embed_tokens_per_layer
        # vLLM's masking: ids outside the table read row 0.
        mask = torch.logical_and(input_ids >= 0, input_ids < self.vocab_size_per_layer_input)
        tokens = torch.where(mask, input_ids, torch.zeros_like(input_ids))
        staged: torch.Tensor = table.stage(tokens.reshape(-1))
        return staged

    def project_per_layer_inputs(
        self, inputs_embeds: torch.Tensor, per_layer_inputs: torch.Tensor | None
    ) -> torch.Tensor | None:
        projection: torch.Tensor | None = super().project_per_layer_inputs(inputs_embeds, None)
        if per_layer_inputs is None or projection is None:
            return projection  # a profiling pass without ids, as vLLM's
        rows: torch.Tensor = self.embed_tokens_per_layer.join(per_layer_inputs)
        # vLLM's get_per_layer_inputs after its lookup, then its combination.
        rows = rows * self.embed_scale_per_layer
        rows = rows.reshape(
            *inputs_embeds.shape[:-1],
            self.config.num_hidden_layers,
            self.hidden_size_per_layer_input,
        )
        combined: torch.Tensor = (projection + rows) * self.per_layer_input_scale
        return combined


def _table_factory(num_embeddings: int, embedding_dim: int, *args: Any, **kwargs: Any) -> Any:
    prefix = str(kwargs.get("prefix", ""))
    if prefix == _TABLE_SUFFIX or prefix.endswith("." + _TABLE_SUFFIX):
        return Gemma4PLEMmapTable(num_embeddings, embedding_dim, *args, **kwargs)
    return _VOCAB_EMBEDDING(num_embeddings, embedding_dim, *args, **kwargs)


_VOCAB_EMBEDDING = vllm_gemma4.VocabParallelEmbedding


@contextlib.contextmanager
def _mmap_table_class() -> Iterator[None]:
    """While the model is built, its per-layer table is ours (``gemma4.py`` builds both of
    its embeddings with the module-level ``VocabParallelEmbedding``; the token table
    stays vLLM's)."""
    vllm_gemma4.VocabParallelEmbedding = _table_factory
    try:
        yield
    finally:
        vllm_gemma4.VocabParallelEmbedding = _VOCAB_EMBEDDING


def _finish_mmap_model(model: Any) -> bool:
    """Switch the built ``Gemma4Model``'s self-decoder to the staging one; whether the
    model has an mmap table (a Gemma 4 without per-layer inputs has none)."""
    if not isinstance(getattr(model, "embed_tokens_per_layer", None), Gemma4PLEMmapTable):
        return False
    decoder = model.self_decoder
    if type(decoder) is not Gemma4SelfDecoderLayers:
        raise UnsupportedError(
            f"ple-memops: Gemma 4's self-decoder is a {type(decoder).__qualname__}, not "
            f"vLLM's {Gemma4SelfDecoderLayers.__qualname__}"
        )
    decoder.__class__ = _MmapSelfDecoderLayers
    return True


class Gemma4MmapForCausalLM(Gemma4ForCausalLM):
    """vLLM's ``Gemma4ForCausalLM``; with ``mmap`` settings its per-layer embedding table
    stays in the checkpoint (see the module)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        mmap = engine_settings(vllm_config).mmap
        with _mmap_table_class() if mmap else contextlib.nullcontext():
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        if mmap and _finish_mmap_model(self.model):
            self.is_unused_checkpoint_weight = is_per_layer_table_weight


class Gemma4MmapForConditionalGeneration(Gemma4ForConditionalGeneration):
    """vLLM's ``Gemma4ForConditionalGeneration``; with ``mmap`` settings its language
    model is :class:`Gemma4MmapForCausalLM`'s (vLLM builds it through the registry),
    ``embed_input_ids`` records the step's per-layer ids instead of looking rows up, and
    the forward stages them inside the graph."""

    ple_memops_ids: torch.Tensor | None

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.ple_memops_ids = None
        language = self.language_model.model
        if not isinstance(getattr(language, "embed_tokens_per_layer", None), Gemma4PLEMmapTable):
            return
        if not isinstance(language.self_decoder, _MmapSelfDecoderLayers):
            raise UnsupportedError(
                "ple-memops: Gemma 4's language model was not built by the plugin's "
                "Gemma4ForCausalLM (is another plugin registering it?)"
            )
        buffer: torch.Tensor | None = self.per_layer_embeddings  # type: ignore[has-type]
        assert buffer is not None
        # The step's ids (graph-static, like vLLM's rows buffer, which is not needed).
        self.ple_memops_ids = torch.zeros(buffer.shape[0], dtype=torch.int64, device=buffer.device)
        self.per_layer_embeddings = None
        self.is_unused_checkpoint_weight = is_per_layer_table_weight

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: Any = None,
        *,
        is_multimodal: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ids = self.ple_memops_ids
        if ids is None:
            stock: torch.Tensor = super().embed_input_ids(
                input_ids, multimodal_embeddings, is_multimodal=is_multimodal
            )
            return stock
        # vLLM's: image and audio positions read row 0.
        if is_multimodal is not None:
            ple_ids = torch.where(
                is_multimodal.to(input_ids.device, non_blocking=True),
                torch.zeros_like(input_ids),
                input_ids,
            )
        else:
            ple_ids = input_ids
        ids[: ple_ids.shape[0]].copy_(ple_ids)
        # vLLM's, minus its rows (SupportsMultiModal's default after Gemma 4's class).
        base: Any = super(Gemma4ForConditionalGeneration, self)
        embeds: torch.Tensor
        if multimodal_embeddings is None or is_multimodal is None:
            embeds = base.embed_input_ids(input_ids)
            return embeds
        embeds = base.embed_input_ids(
            input_ids, multimodal_embeddings=multimodal_embeddings, is_multimodal=is_multimodal
        )
        return embeds

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> Any:
        ids = self.ple_memops_ids
        if ids is None:
            return super().forward(
                input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs
            )
        if intermediate_tensors is not None:
            inputs_embeds = None
        staged = None
        if inputs_embeds is not None:
            # A profiling pass stages the zeros it finds (vLLM's reads a zero buffer).
            staged = self.language_model.model.get_per_layer_inputs(ids[: inputs_embeds.shape[0]])
        self._clear_mm_prefix_for_full_attn_layers()
        return self.language_model.model(
            input_ids,
            positions,
            per_layer_inputs=staged,
            intermediate_tensors=intermediate_tensors,
            inputs_embeds=inputs_embeds,
            **kwargs,
        )


ARCHITECTURES = {
    "Gemma4ForCausalLM": Gemma4MmapForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4MmapForConditionalGeneration,
}


def verify_and_update_config(vllm_config: Any) -> None:
    """The config-time refusals of an engine whose settings say ``mmap`` (called after
    vLLM's own Gemma 4 hook) and its graph mode: a clear error before any weight is read."""
    if not engine_settings(vllm_config).mmap:
        return
    from vllm.config.compilation import CUDAGraphMode

    refused = parallel_refusals(vllm_config)
    if vllm_config.cache_config.kv_sharing_fast_prefill:
        refused.append(
            "kv_sharing_fast_prefill (its self-decoder is compiled and captured apart, PIECEWISE)"
        )
    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if mode == CUDAGraphMode.PIECEWISE:
        refused.append(
            "cudagraph_mode=PIECEWISE (a PIECEWISE graph cannot wait for rows gathered "
            "after its launch; use FULL_DECODE_ONLY, FULL or NONE)"
        )
    raise_refusals(refused)
    if mode is None or mode == CUDAGraphMode.FULL_AND_PIECEWISE:
        compilation.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
        logger.info(
            "ple-memops: cudagraph_mode %s -> FULL_DECODE_ONLY (a PIECEWISE graph cannot "
            "wait for rows gathered after its launch; decodes replay FULL graphs)",
            "(default)" if mode is None else mode.name,
        )


def find_mmap_tables(model: nn.Module) -> list[Gemma4PLEMmapTable]:
    """The model's mmap Gemma 4 tables."""
    return [m for m in find_tables(model) if isinstance(m, Gemma4PLEMmapTable)]
