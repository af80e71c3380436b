"""The Gemma per-layer embedding table served from the checkpoint, shared by the Gemma 4
and Gemma 3n models of :mod:`.gemma4` and :mod:`.gemma3n`.

Both families keep one table for all decoder layers, ``embed_tokens_per_layer``
(``[vocab_size_per_layer_input, num_hidden_layers * hidden_size_per_layer_input]``),
looked up by token id (ids outside the table read row 0) and scaled by
``sqrt(hidden_size_per_layer_input)``. vLLM builds it as a ``VocabParallelEmbedding``
through a module-level name; while an mmap model is built, :func:`table_class` puts
:func:`table_factory`'s in its place, so the table becomes a :class:`PerLayerTokenTable`:
a 0-row placeholder (never allocated, the loader's rows dropped) registered under its name
for the custom ops of :mod:`.ops`, whose :meth:`~PerLayerTokenTable.stage` and
:meth:`~PerLayerTokenTable.join` a model calls where vLLM looked rows up.
:func:`verify_and_update_config` is both families' config hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, cast

import torch
from torch import nn

from ..errors import StateError, UnsupportedError
from . import ops
from .layer import MmapTableLayer, TableExpectations, find_tables
from .settings import SPLIT_REST_THREADS, engine_settings, parallel_refusals, raise_refusals
from .tables import TABLE_DTYPES, LayerTable, find_per_layer_table

__all__ = [
    "SPLIT_REST_THREADS",
    "PerLayerTokenTable",
    "RecordsRowIds",
    "find_mmap_tables",
    "replace_rows_buffer",
    "runs_eagerly",
    "table_class",
    "verify_and_update_config",
]

logger = logging.getLogger("ple_memops")


def _refuse_quantized_table(
    quant_config: Any,
    num_embeddings: int,
    embedding_dim: int,
    params_dtype: torch.dtype | None,
    org_num_embeddings: int | None,
    padding_size: int,
    prefix: str,
) -> None:
    """Raise :class:`~ple_memops.UnsupportedError` if the checkpoint's quantization would
    quantize this table (vLLM's compressed-tensors can quantize embeddings, weight-only
    INT): its rows would not be the BF16/F16/F32 rows this table serves. Asked of vLLM's
    own embedding class, built on the meta device (nothing allocated) with the table's
    arguments."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    with torch.device("meta"):
        probe = VocabParallelEmbedding(
            num_embeddings, embedding_dim, params_dtype=params_dtype,
            org_num_embeddings=org_num_embeddings, padding_size=padding_size,
            quant_config=quant_config, prefix=prefix,
        )  # fmt: skip
    method = probe.quant_method
    if not isinstance(method, UnquantizedEmbeddingMethod):
        name = quant_config.get_name() if hasattr(quant_config, "get_name") else quant_config
        raise UnsupportedError(
            f"ple-memops: the checkpoint's quantization ({name}) quantizes the per-layer "
            f"table {prefix} ({type(method).__name__}); table_backend=mmap serves BF16, "
            "F16 and F32 per-layer tables: serve this checkpoint without it"
        )


class PerLayerTokenTable(nn.Module, MmapTableLayer):
    """A Gemma per-layer embedding table served from the checkpoint's memory map (see the
    module). Built with ``VocabParallelEmbedding``'s arguments."""

    ple_memops_heads = 1
    # stage() stages a split row's rest with decoder layer 0's slice, before either joins.
    ple_memops_staged_first: ClassVar[bool] = True

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
        if quant_config is not None:
            _refuse_quantized_table(
                quant_config, num_embeddings, embedding_dim, params_dtype, org_num_embeddings,
                padding_size, prefix,
            )  # fmt: skip
        # Full rows on every rank (no vocabulary padding or split); the dtype is checked.
        dtype = params_dtype or torch.get_default_dtype()
        self.dtype = dtype
        self.org_vocab_size = int(org_num_embeddings or num_embeddings)
        self.embedding_dim = int(embedding_dim)
        # The table's shape and dtype, nothing allocated (a buffer, not a parameter: the
        # loader expects no rows for it, and load_weights drops any that come).
        self.register_buffer("weight", torch.empty(0, embedding_dim, dtype=dtype), persistent=False)
        self.ple_memops_name = prefix
        self.ple_memops_hooks = None
        self._joins_late = False  # see join_before
        self._deferred: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
        self._deferred = None
        # See split_before: the columns of the checkpoint's rows this table serves (None:
        # whole rows), the decoder layer that first waits for them, and the table serving
        # the rest of each row (with the rows it staged, until its join).
        self.columns: tuple[int, int] | None = None
        self._layer_index = 0
        self._rest: PerLayerTokenTable | None = None
        self._rest_staged: torch.Tensor | None = None
        self._rest_deferred: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
        self._rest_deferred = None
        from vllm.config import get_current_vllm_config

        layers = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in layers:
            raise ValueError(f"Duplicate layer name: {prefix}")
        layers[prefix] = self

    @property
    def row_bytes(self) -> int:
        """Bytes of a row this table serves (its column window's, when split)."""
        cols = self.embedding_dim if self.columns is None else self.columns[1]
        return cols * self.dtype.itemsize

    @property
    def rest(self) -> PerLayerTokenTable | None:
        """The table serving the rest of each row once :meth:`split_before` split it."""
        return self._rest

    @property
    def joins_late(self) -> bool:
        """Whether the rows join at their first consumer (:meth:`join_before`) rather than
        after the projection."""
        return self._joins_late

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
        # Every decoder layer reads its slice of one table: layer 0 waits first; a split
        # table's rest is waited for first by layer 1.
        return self._layer_index

    def ple_memops_table(self, names: Iterable[str]) -> LayerTable:
        return dataclasses.replace(find_per_layer_table(names), columns=self.columns)

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

    # -- the model's calls --------------------------------------------------------------

    def stage(self, ids: torch.Tensor) -> torch.Tensor:
        """Stage the rows of ``ids`` (``[T]``, already masked into the table) with the
        functional ops of a compiled model; returns the token :meth:`join` takes. A split
        table stages its rest's rows too (its token kept here until :meth:`combine`)."""
        staged = ops.stage_ids(ids, self.ple_memops_name)
        if self._rest is not None:
            self._rest_staged = self._rest.stage(ids)
        return staged

    def join(self, staged: torch.Tensor) -> torch.Tensor:
        """The rows :meth:`stage` staged, ready: ``[T, embedding_dim]`` in the table's
        dtype."""
        return ops.read_rows(staged, self.row_bytes, self.ple_memops_name).view(self.dtype)

    def combine(
        self,
        projection: torch.Tensor,
        staged: torch.Tensor,
        rows_scale: torch.Tensor,
        inputs_scale: torch.Tensor,
    ) -> torch.Tensor:
        """Both families' per-layer inputs, as vLLM computes them from the projection of
        the token embedding (``[T, L, d]``) and the rows :meth:`stage` staged::

            (projection + (rows * rows_scale).reshape(projection.shape)) * inputs_scale

        Joined here, unless :meth:`join_before` named a first consumer: then
        ``projection`` itself is returned and completed in place, the same operations in
        the same order (eager, so the same bits), right before that consumer runs."""
        if self._joins_late:
            if self._deferred is not None or self._rest_deferred is not None:
                raise StateError(
                    f"ple-memops: {self.ple_memops_name}: the previous forward's rows were "
                    "never joined (a decoder layer's per-layer gate did not run)"
                )
            self._deferred = (projection, staged, rows_scale, inputs_scale)
            if self._rest is not None:
                rest, self._rest_staged = self._rest_staged, None
                if rest is None:
                    raise StateError(
                        f"ple-memops: {self.ple_memops_name}: the rest of the rows was not "
                        "staged with decoder layer 0's slice"
                    )
                self._rest_deferred = (projection, rest, rows_scale, inputs_scale)
            return projection
        rows = self.join(staged) * rows_scale
        combined: torch.Tensor = (projection + rows.reshape(projection.shape)) * inputs_scale
        return combined

    def join_before(self, consumer: nn.Module) -> None:
        """Join the rows :meth:`combine` deferred right before ``consumer`` runs (decoder
        layer 0's per-layer input gate: the first module whose output meets the rows),
        instead of after the projection at the top of the forward. For a model that runs
        eagerly (``-O0``, graphs captured from eager code): there the order of the calls
        is the order of the kernels, and the host's gather then hides behind all of layer
        0 but its last matmuls. A compiled model keeps the join in :meth:`combine`
        (Inductor places it; moving the arithmetic across vLLM's graph pieces would
        change its fusion, so its bits)."""
        # (A flag, not the module: a module attribute would make it the table's child.)
        self._joins_late = True
        consumer.register_forward_pre_hook(self._join_deferred)

    def split_before(self, consumer: nn.Module, rest_consumer: nn.Module, layer_cols: int) -> None:
        """As :meth:`join_before`, with each row split in two tables of the same checkpoint
        tensor (column windows, :meth:`~ple_memops.MmapTable.open`'s ``columns``): this
        one serves decoder layer 0's slice (the first ``layer_cols`` columns) and joins it
        right before ``consumer`` (layer 0's per-layer gate); :attr:`rest` serves every
        later layer's slices and joins them right before ``rest_consumer`` (layer 1's
        gate). The GPU then waits at layer 0 for a row's first slice only (512 B of a
        Gemma row's 15-21 KiB), and the rest of the gather hides behind a second decoder
        layer. The same operations on the same elements: the same bits."""
        layers, rem = divmod(self.embedding_dim, layer_cols)
        if rem or layers < 2 or layer_cols <= 0:
            raise ValueError(
                f"{self.ple_memops_name}: rows of {self.embedding_dim} columns do not split "
                f"into at least two layers' slices of {layer_cols}"
            )
        rest = PerLayerTokenTable(
            self.org_vocab_size,
            self.embedding_dim,
            params_dtype=self.dtype,
            prefix=f"{self.ple_memops_name}.rest",
        )
        rest.columns = (layer_cols, self.embedding_dim - layer_cols)
        rest._layer_index = 1
        rest._joins_late = True
        self.columns = (0, layer_cols)
        self.ple_memops_lead_threads = False  # 512 B a token: the rest's fill is the long one
        rest.ple_memops_own_threads = SPLIT_REST_THREADS
        self._rest = rest  # a child module: the runner finds it among the model's tables
        self.join_before(consumer)
        rest_consumer.register_forward_pre_hook(self._join_rest)

    def _join_deferred(self, module: nn.Module, args: Any) -> None:
        deferred, self._deferred = self._deferred, None
        if deferred is not None:  # else a profiling pass, without rows
            # [T, L, d]: every layer's slice, or decoder layer 0's of a split row.
            _complete(self, deferred, slice(None) if self._rest is None else slice(0, 1))

    def _join_rest(self, module: nn.Module, args: Any) -> None:
        deferred, self._rest_deferred = self._rest_deferred, None
        if deferred is not None and self._rest is not None:
            _complete(self._rest, deferred, slice(1, None))  # every later layer's slices

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "mmap per-layer embedding: rows are staged by stage() and read after join()"
        )


def _complete(
    table: PerLayerTokenTable,
    deferred: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    layers: slice,
) -> None:
    """vLLM's combination, in place on ``layers`` of the deferred projection (``[T, L,
    d]``), with ``table``'s staged rows: ``(projection + rows * rows_scale) *
    inputs_scale``, the same operations in the same order as the stock model's."""
    projection, staged, rows_scale, inputs_scale = deferred
    part = projection[:, layers, :]
    rows = table.join(staged) * rows_scale
    part.add_(rows.reshape(part.shape))
    part.mul_(inputs_scale)


@contextlib.contextmanager
def table_class(module: Any, suffix: str) -> Iterator[None]:
    """While the block runs, ``module``'s ``VocabParallelEmbedding`` builds a
    :class:`PerLayerTokenTable` for a prefix ending in ``suffix`` (vLLM's prefix of the
    per-layer table) and vLLM's class for every other embedding."""
    stock = module.VocabParallelEmbedding
    module.VocabParallelEmbedding = table_factory(stock, suffix)
    try:
        yield
    finally:
        module.VocabParallelEmbedding = stock


def table_factory(stock: type, suffix: str) -> Callable[..., Any]:
    """``VocabParallelEmbedding``'s stand-in (see :func:`table_class`)."""

    def build(num_embeddings: int, embedding_dim: int, *args: Any, **kwargs: Any) -> Any:
        prefix = str(kwargs.get("prefix", ""))
        if prefix == suffix or prefix.endswith("." + suffix):
            return PerLayerTokenTable(num_embeddings, embedding_dim, *args, **kwargs)
        return stock(num_embeddings, embedding_dim, *args, **kwargs)

    return build


def replace_rows_buffer(model: Any) -> torch.Tensor:
    """A multimodal Gemma's ``per_layer_embeddings`` (the ``[max_num_batched_tokens, L, d]``
    buffer vLLM looks each step's rows up into, eagerly) replaced by the step's ids
    (``int64 [max_num_batched_tokens]``, graph-static like the buffer), which the model's
    forward stages inside the graph; the table's checkpoint weight marked unused."""
    from .tables import is_per_layer_table_weight

    buffer: torch.Tensor | None = model.per_layer_embeddings
    assert buffer is not None
    ids = torch.zeros(buffer.shape[0], dtype=torch.int64, device=buffer.device)
    model.per_layer_embeddings = None
    model.is_unused_checkpoint_weight = is_per_layer_table_weight
    return ids


class RecordsRowIds:
    """A mixin before vLLM's multimodal Gemma class in the bases. vLLM's class looks the
    step's rows up eagerly in ``embed_input_ids``; with ``mmap`` settings (its
    ``ple_memops_ids``, from :func:`replace_rows_buffer`, not ``None``) this records the
    step's row ids there instead and embeds the tokens as vLLM's class does after its
    lookup (its ``SupportsMultiModal`` base); its forward stages the recorded ids inside
    the graph (:meth:`ple_memops_per_layer_inputs`, each family's) where vLLM's slices
    its buffer, and runs the language model as vLLM's does."""

    ple_memops_ids: torch.Tensor | None = None
    ple_memops_vllm_class: ClassVar[type]
    """The vLLM class this one subclasses."""

    def ple_memops_row_ids(
        self, input_ids: torch.Tensor, is_multimodal: torch.Tensor | None
    ) -> torch.Tensor:
        """The ids vLLM's class looks rows up for (it masks them into the table later)."""
        return input_ids

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: Any = None,
        *,
        is_multimodal: torch.Tensor | None = None,
    ) -> torch.Tensor:
        embeds: torch.Tensor
        ids = self.ple_memops_ids
        if ids is None:
            embeds = cast(Any, super()).embed_input_ids(
                input_ids, multimodal_embeddings, is_multimodal=is_multimodal
            )
            return embeds
        if input_ids is not None:
            row_ids = self.ple_memops_row_ids(input_ids, is_multimodal)
            ids[: row_ids.shape[0]].copy_(row_ids)
        base = cast(Any, super(self.ple_memops_vllm_class, self))
        if multimodal_embeddings is None or is_multimodal is None:
            embeds = base.embed_input_ids(input_ids)
            return embeds
        embeds = base.embed_input_ids(
            input_ids, multimodal_embeddings=multimodal_embeddings, is_multimodal=is_multimodal
        )
        return embeds

    def ple_memops_per_layer_inputs(
        self,
        ids: torch.Tensor,
        intermediate_tensors: Any,
        inputs_embeds: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """What vLLM's forward does before it runs the language model, with the recorded
        ``ids`` staged where it slices its rows buffer: the per-layer inputs it hands the
        language model (``inputs_embeds`` is ``None`` when ``intermediate_tensors`` is
        given, as vLLM's forward sets it). Each family's class defines it."""
        raise NotImplementedError(
            f"{type(self).__qualname__} does not say how it stages its per-layer inputs"
        )

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> Any:
        ids = self.ple_memops_ids
        if ids is None:
            return cast(Any, super()).forward(
                input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs
            )
        if intermediate_tensors is not None:
            inputs_embeds = None
        staged = self.ple_memops_per_layer_inputs(ids, intermediate_tensors, inputs_embeds)
        return cast(Any, self).language_model.model(
            input_ids,
            positions,
            per_layer_inputs=staged,
            intermediate_tensors=intermediate_tensors,
            inputs_embeds=inputs_embeds,
            **kwargs,
        )


def runs_eagerly(vllm_config: Any) -> bool:
    """Whether vLLM runs the model's forward as written (``-O0``: compilation mode
    ``NONE``), so the order of its calls is the order of its kernels."""
    from vllm.config.compilation import CompilationMode

    return bool(vllm_config.compilation_config.mode == CompilationMode.NONE)


def find_mmap_tables(model: nn.Module) -> list[PerLayerTokenTable]:
    """The model's mmap per-layer tables."""
    return [m for m in find_tables(model) if isinstance(m, PerLayerTokenTable)]


def verify_and_update_config(vllm_config: Any) -> None:
    """The config-time refusals of a Gemma engine whose settings say ``mmap`` (called
    after vLLM's own hook for the architecture, where it has one) and its graph mode: a
    clear error before any weight is read."""
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
