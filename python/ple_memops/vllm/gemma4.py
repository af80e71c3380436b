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

* :class:`~.token_table.PerLayerTokenTable` (shared with Gemma 3n) replaces the table
  module while the model is built: a 0-row placeholder (never allocated, the loader's
  rows dropped), registered under its name for the custom ops of :mod:`.ops`;
* the model's ``get_per_layer_inputs`` stages the rows of the (masked) ids with
  ``stage_ids`` instead of looking them up, and ``project_per_layer_inputs`` computes
  the projection first, then the stock arithmetic on the rows, the same operations in
  the same order (compiled alike by Inductor: the functional ops of :mod:`.ops`, since
  vLLM compiles Gemma 4), so the tokens are the stock engine's. Where the rows join: in
  a model run eagerly (``-O0``), right before decoder layer 0's per-layer input gate,
  their first consumer (:meth:`~.token_table.PerLayerTokenTable.join_before`: the host's
  gather hides behind layer 0's attention and MLP; with ``split_rows``, layer 0's slice
  of each row there and the rest, a second table of the same tensor, at layer 1's gate:
  :meth:`~.token_table.PerLayerTokenTable.split_before`); compiled, where Inductor places
  ``read_rows`` (right before its first consumer in the first of vLLM's graph pieces);
* :class:`Gemma4MmapForCausalLM` and :class:`Gemma4MmapForConditionalGeneration`,
  registered under vLLM's own architecture names, build that for an engine whose
  settings say ``mmap`` and are vLLM's classes unchanged otherwise. The multimodal
  class computes the rows in ``embed_input_ids``, eagerly, outside the CUDA graph;
  here it only records the step's ids there (image and audio tokens read row 0, as
  vLLM's) and the rows are staged in the forward, inside the graph;
* :func:`~.token_table.verify_and_update_config`, the config-time refusals and the graph mode: the
  custom ops cannot sit inside a PIECEWISE graph, so ``FULL_AND_PIECEWISE`` becomes
  ``FULL_DECODE_ONLY`` (decodes replay FULL graphs that defer their rows; prefills and
  mixed batches run compiled, without graphs, and defer theirs too). Async scheduling
  stays as the engine asked.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from vllm.model_executor.models import gemma4 as vllm_gemma4
from vllm.model_executor.models.gemma4 import Gemma4ForCausalLM, Gemma4SelfDecoderLayers
from vllm.model_executor.models.gemma4_mm import Gemma4ForConditionalGeneration

from ..errors import UnsupportedError
from .settings import engine_settings
from .tables import is_per_layer_table_weight
from .token_table import (
    PerLayerTokenTable,
    RecordsRowIds,
    find_mmap_tables,
    replace_rows_buffer,
    runs_eagerly,
    table_class,
    verify_and_update_config,
)

__all__ = [
    "ARCHITECTURES",
    "Gemma4MmapForCausalLM",
    "Gemma4MmapForConditionalGeneration",
    "find_mmap_tables",
    "verify_and_update_config",
]

_TABLE_SUFFIX = "embed_tokens_per_layer"


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
        table: PerLayerTokenTable = self.embed_tokens_per_layer
        # vLLM's get_per_layer_inputs after its lookup, then its combination (joined
        # here, or at layer 0's gate).
        return table.combine(
            projection, per_layer_inputs, self.embed_scale_per_layer, self.per_layer_input_scale
        )


def _finish_mmap_model(model: Any, eager: bool, split: bool = False) -> bool:
    """Switch the built ``Gemma4Model``'s self-decoder to the staging one (``eager``: the
    rows join at decoder layer 0's per-layer gate; ``split`` too: layer 0's slice there,
    the rest at layer 1's); whether the model has an mmap table (a Gemma 4 without
    per-layer inputs has none)."""
    table = getattr(model, "embed_tokens_per_layer", None)
    if not isinstance(table, PerLayerTokenTable):
        return False
    decoder = model.self_decoder
    if type(decoder) is not Gemma4SelfDecoderLayers:
        raise UnsupportedError(
            f"ple-memops: Gemma 4's self-decoder is a {type(decoder).__qualname__}, not "
            f"vLLM's {Gemma4SelfDecoderLayers.__qualname__}"
        )
    decoder.__class__ = _MmapSelfDecoderLayers
    if eager:
        gate = getattr(model.layers[model.start_layer], "per_layer_input_gate", None)
        if gate is None:
            raise UnsupportedError(
                "ple-memops: Gemma 4's first decoder layer has no per-layer input gate, "
                "though the model has a per-layer table"
            )
        layers = model.end_layer - model.start_layer
        if split and layers >= 2:
            then = getattr(model.layers[model.start_layer + 1], "per_layer_input_gate", None)
            if then is None:
                raise UnsupportedError(
                    "ple-memops: Gemma 4's second decoder layer has no per-layer input "
                    "gate, though the model has a per-layer table"
                )
            table.split_before(gate, then, int(model.hidden_size_per_layer_input))
        else:
            table.join_before(gate)
    return True


class Gemma4MmapForCausalLM(Gemma4ForCausalLM):
    """vLLM's ``Gemma4ForCausalLM``; with ``mmap`` settings its per-layer embedding table
    stays in the checkpoint (see the module)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        mmap = engine_settings(vllm_config).mmap
        with table_class(vllm_gemma4, _TABLE_SUFFIX) if mmap else contextlib.nullcontext():
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        settings = engine_settings(vllm_config)
        late = runs_eagerly(vllm_config) and not settings.diag_early_join
        if mmap and _finish_mmap_model(self.model, late, settings.split_rows):
            self.is_unused_checkpoint_weight = is_per_layer_table_weight


class Gemma4MmapForConditionalGeneration(RecordsRowIds, Gemma4ForConditionalGeneration):
    """vLLM's ``Gemma4ForConditionalGeneration``; with ``mmap`` settings its language
    model is :class:`Gemma4MmapForCausalLM`'s (vLLM builds it through the registry),
    ``embed_input_ids`` records the step's per-layer ids instead of looking rows up, and
    the forward stages them inside the graph."""

    ple_memops_vllm_class = Gemma4ForConditionalGeneration

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.ple_memops_ids = None
        language = self.language_model.model
        if not isinstance(getattr(language, "embed_tokens_per_layer", None), PerLayerTokenTable):
            return
        if not isinstance(language.self_decoder, _MmapSelfDecoderLayers):
            raise UnsupportedError(
                "ple-memops: Gemma 4's language model was not built by the plugin's "
                "Gemma4ForCausalLM (is another plugin registering it?)"
            )
        self.ple_memops_ids = replace_rows_buffer(self)

    def ple_memops_row_ids(
        self, input_ids: torch.Tensor, is_multimodal: torch.Tensor | None
    ) -> torch.Tensor:
        # vLLM's: image and audio positions read row 0.
        if is_multimodal is None:
            return input_ids
        return torch.where(
            is_multimodal.to(input_ids.device, non_blocking=True),
            torch.zeros_like(input_ids),
            input_ids,
        )

    def ple_memops_per_layer_inputs(
        self,
        ids: torch.Tensor,
        intermediate_tensors: Any,
        inputs_embeds: torch.Tensor | None,
    ) -> torch.Tensor | None:
        staged = None
        if inputs_embeds is not None:
            # A profiling pass stages the zeros it finds (vLLM's reads a zero buffer).
            staged = self.language_model.model.get_per_layer_inputs(ids[: inputs_embeds.shape[0]])
        # vLLM's, between its per-layer inputs and the language model (outside the graph).
        self._clear_mm_prefix_for_full_attn_layers()
        return staged


ARCHITECTURES = {
    "Gemma4ForCausalLM": Gemma4MmapForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4MmapForConditionalGeneration,
}
