"""Qwen4Exp's n-gram PLE row ids computed on the host, equal to vLLM's own.

vLLM computes a step's row ids on the GPU (``Qwen4ExpNGramEmbedding.compute_ngram_ids``)
from the step's token ids, so under async scheduling a decode step's ids exist only on the
GPU when the step is launched. A prefill chunk's tokens, and the tokens before it, are
the prompt's: the host knows them when the step is scheduled, and with the hash's
parameters as loaded it can compute the same ids and start the gather before the GPU
reaches the step. :class:`HostNGramIds` is that computation (native, the GIL released:
``ple_memops._native.NGramHashCore``), with no torch and no device:

    ids = HostNGramIds.from_module(ngram_embedding)     # once, after the weights load
    ids(tokens, query_start_loc, ngram_context)          # compute_ngram_ids' arguments
    ids.for_requests(token_ids, computed, scheduled)     # a step's prompt chunks
    ids.ids_at(all_token_ids, rows, positions)           # a decode step's, from the history

For each token and each n-gram order ``n`` (2..``ngram_size``) the hash is
``xor_k(token[t - k] * multiplier[k])`` over ``k < n`` (64-bit wrapping products); a
predecessor at or before the last EOS before ``t`` reads as EOS, and the request's
``ngram_size - 1`` tokens before the chunk (``ngram_context``, EOS before the request's
start) come first. Each of the ``heads_per_ngram`` heads of an order maps the hash into
its own vocabulary, ``offset[h] + hash mod size[h]`` (a non-negative remainder of the
signed hash): one global row of the layer's table per (token, head), in vLLM's order
(orders ascending, heads within an order).

The parameters are read from the module (``layer_multipliers``, ``ngram_heads_vocab_sizes``,
``ngram_heads_offsets``, ``eos_token_id``, ``ngram_size``, ``heads_per_ngram``), which vLLM's
loader overwrites from the checkpoint when it holds them: read them after loading.
``tests/test_vllm_real.py`` checks the ids against ``compute_ngram_ids`` itself, in CI's
vLLM environment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _native
from ..errors import InvalidArgumentError
from .prefill import as_int64 as _int64
from .prefill import history_array, request_chunks

__all__ = ["HostNGramIds"]


@dataclass(frozen=True)
class HostNGramIds:
    """One PLE layer's n-gram hash (see the module docs). Immutable; thread-safe."""

    multipliers: np.ndarray
    """``int64 [ngram_size]``: one odd multiplier per distance back."""
    sizes: np.ndarray
    """``int64 [heads]``: each head's vocabulary size."""
    offsets: np.ndarray
    """``int64 [heads]``: each head's first row in the layer's table."""
    eos_token_id: int
    ngram_size: int
    heads_per_ngram: int
    _core: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n, h = self.ngram_size, self.heads_per_ngram
        if n < 2 or h < 1:
            raise InvalidArgumentError(f"ngram_size {n} must be >= 2 and heads_per_ngram {h} >= 1")
        if self.multipliers.shape != (n,):
            raise InvalidArgumentError(
                f"{self.multipliers.shape[0]} multipliers for ngram_size {n}"
            )
        heads = (n - 1) * h
        if self.sizes.shape != (heads,) or self.offsets.shape != (heads,):
            raise InvalidArgumentError(
                f"{self.sizes.shape[0]} vocabulary sizes and {self.offsets.shape[0]} offsets "
                f"for {heads} heads"
            )
        if (self.sizes <= 0).any():
            raise InvalidArgumentError("every head's vocabulary size must be positive")
        core = _native.NGramHashCore(
            self.multipliers.tolist(),
            self.sizes.tolist(),
            self.offsets.tolist(),
            int(self.eos_token_id),
            int(h),
        )
        object.__setattr__(self, "_core", core)

    @classmethod
    def from_module(cls, module: Any) -> HostNGramIds:
        """The hash of a loaded ``Qwen4ExpNGramEmbedding`` (its buffers copied to the host
        once: never call this per step)."""

        def host(name: str) -> np.ndarray:
            value = getattr(module, name, None)
            if value is None:
                raise InvalidArgumentError(
                    f"{type(module).__qualname__} has no {name!r}: not a Qwen4Exp n-gram embedding"
                )
            return _int64(value.detach().cpu().reshape(-1), name)

        return cls(
            multipliers=host("layer_multipliers"),
            sizes=host("ngram_heads_vocab_sizes"),
            offsets=host("ngram_heads_offsets"),
            eos_token_id=int(module.eos_token_id),
            ngram_size=int(module.ngram_size),
            heads_per_ngram=int(module.heads_per_ngram),
        )

    @property
    def heads(self) -> int:
        """Row ids per token."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    def __call__(self, tokens: Any, query_start_loc: Any, ngram_context: Any) -> np.ndarray:
        """``compute_ngram_ids``' result for the same arguments: ``tokens`` (``[T]``, the
        requests' chunks back to back), ``query_start_loc`` (``[R + 1]``, non-decreasing,
        from 0) and ``ngram_context`` (``[>= R, ngram_size - 1]``, the tokens before each
        chunk); returns ``int64 [T, heads]``. Tokens past ``query_start_loc[R]`` belong to
        the last request, as on the GPU."""
        toks = _int64(tokens, "tokens").reshape(-1)
        qsl = _int64(query_start_loc, "query_start_loc").reshape(-1)
        ctx = _int64(ngram_context, "ngram_context").reshape(-1)
        c = self.ngram_size - 1
        if qsl.size >= 2 and ctx.size < (qsl.size - 1) * c:
            raise InvalidArgumentError(
                f"ngram_context has {ctx.size // c} rows of {c} tokens for {qsl.size - 1} requests"
            )
        ids: np.ndarray = self._core.ids(toks, qsl, ctx[: max(qsl.size - 1, 0) * c])
        return ids

    @property
    def inputs_key(self) -> tuple[int, int]:
        """What :meth:`inputs` depends on besides the requests: hashes with equal keys
        (the PLE layers of one model) share a step's inputs."""
        return (self.ngram_size, self.eos_token_id)

    def ids_at(self, history: np.ndarray, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``int64 [len(rows), heads]``: the ids of request ``i``'s token at ``positions[i]``
        of ``history`` row ``rows[i]`` (``int32 [requests, width]``, C-contiguous: vLLM's
        ``all_token_ids`` as the host sees it), after the ``ngram_size - 1`` tokens before
        it (EOS before position 0): a decode step's ids, read natively, the GIL released."""
        ids: np.ndarray = self._core.ids_at(
            history_array(history), _int64(rows, "rows"), _int64(positions, "positions")
        )
        return ids

    def inputs(
        self,
        token_ids: Sequence[Any],
        computed: Sequence[int],
        scheduled: Sequence[int],
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, query_start_loc, ngram_context)`` of a step whose requests' tokens
        the host knows: request ``r``'s ``scheduled[r]`` tokens from position
        ``computed[r]`` of ``token_ids[r]`` (its prompt, or every token it has), its context
        the ``ngram_size - 1`` tokens before them (EOS before position 0), as vLLM's
        Qwen4Exp model state builds it."""
        c = self.ngram_size - 1
        ctx = np.full((max(len(token_ids), 1), c), self.eos_token_id, np.int64)
        chunks: list[np.ndarray] = []
        qsl = [0]
        for r, (arr, start, count) in enumerate(request_chunks(token_ids, computed, scheduled)):
            chunks.append(arr[start : start + count])
            before = arr[max(0, start - c) : start]
            if before.size:
                ctx[r, c - before.size :] = before
            qsl.append(qsl[-1] + count)
        tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
        return tokens, np.asarray(qsl, dtype=np.int64), ctx

    def for_requests(
        self,
        token_ids: Sequence[Any],
        computed: Sequence[int],
        scheduled: Sequence[int],
    ) -> np.ndarray:
        """The ids of :meth:`inputs`' step: ``int64 [sum(scheduled), heads]``, the rows in
        step order."""
        return self(*self.inputs(token_ids, computed, scheduled))
