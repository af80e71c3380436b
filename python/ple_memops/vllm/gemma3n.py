"""vLLM 0.33.0's Gemma 3n with its per-layer embedding table served from the checkpoint.

Imported only once the plugin is switched on (it subclasses vLLM's classes).

Gemma 3n keeps one table for all decoder layers, ``embed_tokens_per_layer``
(``[vocab_size_per_layer_input, num_hidden_layers * 256]``, E2B: 262,144 rows of 30 x 256
BF16 values, 4.0 GB). The released checkpoints are ``Gemma3nForConditionalGeneration``,
whose ``embed_input_ids`` looks the step's rows up eagerly, outside the CUDA graph, and
scales them by ``sqrt(256)`` into a ``[max_num_batched_tokens, L, 256]`` buffer; its
forward hands the step's slice to the compiled text model, whose self-decoder combines it
with a projection of the token embedding before the first layer::

    per_layer_inputs = (norm(proj(h0)) + rows * 16) * 2**-0.5     # [T, L, 256]

and each decoder layer reads its slice at its end. With ``mmap`` settings:

* the table module is a :class:`~.token_table.PerLayerTokenTable` (never allocated, the
  loader's rows dropped; shared with Gemma 4), and vLLM's rows buffer is not allocated;
* ``embed_input_ids`` only records the step's ids (graph-static, like vLLM's buffer), and
  the forward stages them inside the graph, where vLLM read its buffer;
* the self-decoder computes the projection, then vLLM's arithmetic on the rows (the
  scale, then the add and the scale; multiplying BF16 by 16 is exact, so scaling inside
  the graph instead of eagerly gives the same bits). Where the rows join: in a model run
  eagerly (``-O0``), right before decoder layer 0's per-layer input gate, their first
  consumer (the combination then completes the projection in place there), so the
  host's gather overlaps all of layer 0's attention and MLP; in a compiled model, after
  the projection, where Inductor places it within the first of vLLM's graph pieces
  (the token embedding, the projection and layer 0 up to its attention). With
  ``split_rows`` (eager only) layer 0's slice of each row and the rest are two tables,
  joined at layer 0's and layer 1's gates (:meth:`~.token_table.PerLayerTokenTable.split_before`).

Refusals and the graph mode are Gemma 4's (:func:`~.token_table.verify_and_update_config`).
The text-only ``Gemma3nForCausalLM`` is left as vLLM has it: in vLLM 0.33.0 its forward is
never given per-layer inputs (it takes its profiling branch and runs without the table's
rows), so there is nothing of the table to serve.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from vllm.model_executor.models import gemma3n as vllm_gemma3n
from vllm.model_executor.models.gemma3n import Gemma3nSelfDecoder
from vllm.model_executor.models.gemma3n_mm import Gemma3nForConditionalGeneration

from ..errors import UnsupportedError
from .settings import engine_settings
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
    "Gemma3nMmapForConditionalGeneration",
    "find_mmap_tables",
    "verify_and_update_config",
]

# vLLM's prefix for the per-layer table module (its attribute is embed_tokens_per_layer).
_TABLE_PREFIX = "per_layer_embed_tokens"


class _MmapSelfDecoder(Gemma3nSelfDecoder):
    """vLLM's ``Gemma3nSelfDecoder`` (which owns the table, the projection and their
    combination) with the rows staged and joined around the projection (the class of the
    built module is switched; nothing else of it changes)."""

    def get_per_layer_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        # vLLM's masking (ids outside the table read row 0); the rows are staged, not read.
        mask = torch.logical_and(input_ids >= 0, input_ids < self.config.vocab_size_per_layer_input)
        tokens = torch.where(mask, input_ids, torch.zeros_like(input_ids))
        table: PerLayerTokenTable = self.embed_tokens_per_layer
        staged: torch.Tensor = table.stage(tokens.reshape(-1))
        return staged

    def get_per_layer_inputs(
        self, hidden_states_0: torch.Tensor, per_layer_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        projection: torch.Tensor = super().get_per_layer_inputs(hidden_states_0, None)
        if per_layer_inputs is None:
            return projection
        table: PerLayerTokenTable = self.embed_tokens_per_layer
        # vLLM's, in the multimodal class's embed_input_ids: scaled after the lookup, then
        # shaped [T, L, d]; then its combination (joined here, or at layer 0's gate).
        return table.combine(
            projection, per_layer_inputs, self.embed_scale_per_layer, self.per_layer_input_scale
        )


class Gemma3nMmapForConditionalGeneration(RecordsRowIds, Gemma3nForConditionalGeneration):
    """vLLM's ``Gemma3nForConditionalGeneration``; with ``mmap`` settings its per-layer
    embedding table stays in the checkpoint (see the module)."""

    ple_memops_vllm_class = Gemma3nForConditionalGeneration

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        mmap = engine_settings(vllm_config).mmap
        # The language model is built inside (vLLM's Gemma3nForCausalLM, whose
        # self-decoder builds the table with gemma3n's module-level class).
        with table_class(vllm_gemma3n, _TABLE_PREFIX) if mmap else contextlib.nullcontext():
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.ple_memops_ids = None
        if not mmap:
            return
        decoder = self.language_model.model.self_decoder
        if not isinstance(decoder.embed_tokens_per_layer, PerLayerTokenTable):
            raise UnsupportedError(
                "ple-memops: Gemma 3n's per-layer table was not built by the plugin (is "
                "another plugin registering Gemma3nForCausalLM?)"
            )
        if type(decoder) is not Gemma3nSelfDecoder:
            raise UnsupportedError(
                f"ple-memops: Gemma 3n's self-decoder is a {type(decoder).__qualname__}, not "
                f"vLLM's {Gemma3nSelfDecoder.__qualname__}"
            )
        decoder.__class__ = _MmapSelfDecoder
        settings = engine_settings(vllm_config)
        if runs_eagerly(vllm_config) and not settings.diag_early_join:
            table: PerLayerTokenTable = decoder.embed_tokens_per_layer
            layers = self.language_model.model.layers  # all of them, both decoders'
            if settings.split_rows and len(layers) >= 2:
                table.split_before(
                    layers[0].per_layer_input_gate,
                    layers[1].per_layer_input_gate,
                    int(decoder.config.hidden_size_per_layer_input),
                )
            else:
                table.join_before(decoder.decoder_layers[0].per_layer_input_gate)
        self.ple_memops_ids = replace_rows_buffer(self)

    def ple_memops_per_layer_inputs(
        self,
        ids: torch.Tensor,
        intermediate_tensors: Any,
        inputs_embeds: torch.Tensor | None,
    ) -> torch.Tensor:
        # vLLM's: a profiling pass reads what the buffer holds (here: stages its zeros).
        if inputs_embeds is not None:
            num_tokens = inputs_embeds.shape[0]
        elif intermediate_tensors is not None:
            num_tokens = intermediate_tensors["hidden_states"].shape[0]
        else:
            raise ValueError("inputs_embeds is required on the first PP rank")
        decoder = self.language_model.model.self_decoder
        staged: torch.Tensor = decoder.get_per_layer_input_embeddings(ids[:num_tokens])
        return staged


ARCHITECTURES = {"Gemma3nForConditionalGeneration": Gemma3nMmapForConditionalGeneration}
