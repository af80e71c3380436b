"""Qwen4Exp n-gram PLE row ids, in torch, written from the model's definition: what the
tests compute the ids with where they stand in for vLLM's model (checked against vLLM's own
``compute_ngram_ids`` in ``test_vllm_real.py``).

For each token, n-gram ``n`` (2..``ngram_size``) hashes the token and its ``n - 1``
predecessors: ``xor_k(token[t - k] * multiplier[k])`` over ``k < n`` (64-bit wrapping
products). Predecessors come from the same request's tokens in this step, else from the
request's ``ngram_context`` (the ``ngram_size - 1`` tokens before the step); a predecessor
at or before an earlier EOS reads as EOS. Each n-gram has ``heads_per_ngram`` heads; head
``h`` maps the hash into its own prime-sized vocabulary and adds the vocabulary's offset,
so an id is a global row of the layer's table: ``offset[h] + hash mod size[h]``.

Vocabulary sizes are the consecutive primes at or above ``ngram_vocab_size_base``, indexed
by the head's global number ``dense_layer_id * heads + h``; the table has
``sum(sizes)`` rows rounded up to ``make_ngram_vocab_size_divisible_by``. Multipliers are
odd 64-bit values from a SplitMix64 stream seeded per PLE layer.

Everything :class:`NGramHasher` runs on the device is fixed-shape with no host
synchronisation, so it can be captured in a CUDA graph (the ids of a decode step exist
only on the GPU when the step is launched).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["NGramHasher", "NGramLayout"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64 increment
_LAYER_SEED_STRIDE = 10007


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (the first twelve prime bases)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _primes_from(start: int, count: int) -> list[int]:
    """The first ``count`` primes >= ``start``."""
    out: list[int] = []
    n = max(2, start)
    while len(out) < count:
        if _is_prime(n):
            out.append(n)
        n += 1
    return out


@dataclass(frozen=True)
class NGramLayout:
    """One PLE layer's hashing constants and table layout."""

    ngram_size: int
    heads_per_ngram: int
    eos_token_id: int
    multipliers: tuple[int, ...]
    """``ngram_size`` signed 64-bit multipliers (index ``k`` weighs ``token[t - k]``)."""
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    rows: int
    """Table rows: ``sum(sizes)`` rounded up to the divisibility the model asks for."""

    @property
    def heads(self) -> int:
        """Row ids per token: ``(ngram_size - 1) * heads_per_ngram``."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @classmethod
    def qwen4exp(
        cls,
        *,
        ngram_size: int,
        heads_per_ngram: int,
        vocab_size: int,
        ngram_vocab_size_base: int,
        make_ngram_vocab_size_divisible_by: int,
        seed: int,
        dense_layer_id: int,
        eos_token_id: int,
    ) -> NGramLayout:
        """The layout of PLE layer number ``dense_layer_id`` (its rank among the model's
        PLE layers) from the model config's values."""
        if ngram_size < 2 or heads_per_ngram < 1 or vocab_size < 1:
            raise ValueError("need ngram_size >= 2, heads_per_ngram >= 1 and vocab_size >= 1")
        heads = (ngram_size - 1) * heads_per_ngram
        # Products token * multiplier must stay below 2**63 for every token id.
        half = max(1, ((1 << 63) - 1) // vocab_size // 2)
        layer_seed = seed + _LAYER_SEED_STRIDE * dense_layer_id
        mults = tuple(
            2 * (_splitmix64(layer_seed + _GOLDEN * (k + 1)) % half) + 1 for k in range(ngram_size)
        )
        primes = _primes_from(ngram_vocab_size_base, (dense_layer_id + 1) * heads)
        sizes = tuple(primes[dense_layer_id * heads :])
        offsets = tuple(sum(sizes[:h]) for h in range(heads))
        div = make_ngram_vocab_size_divisible_by
        rows = -(-sum(sizes) // div) * div
        return cls(ngram_size, heads_per_ngram, eos_token_id, mults, sizes, offsets, rows)

    @classmethod
    def from_config(cls, config: Any, dense_layer_id: int) -> NGramLayout:
        """From a ``transformers`` ``Qwen4ExpTextConfig`` (or anything with its fields)."""
        return cls.qwen4exp(
            ngram_size=int(config.ngram_size),
            heads_per_ngram=int(config.heads_per_ngram),
            vocab_size=int(config.vocab_size),
            ngram_vocab_size_base=int(config.ngram_vocab_size_base),
            make_ngram_vocab_size_divisible_by=int(config.make_ngram_vocab_size_divisible_by),
            seed=int(getattr(config, "seed", 1234)),
            dense_layer_id=dense_layer_id,
            eos_token_id=int(config.eos_token_id),
        )


def _signed64(values: Sequence[int]) -> list[int]:
    return [v - (1 << 64) if v >= 1 << 63 else v for v in values]


class NGramHasher:
    """Computes one layer's ids ``int64 [tokens, heads]`` on a device.

    Create it outside graph capture (it copies its constants to the device once); calls
    allocate only device temporaries and never synchronise, so they can be captured.
    """

    def __init__(self, layout: NGramLayout, device: Any = "cpu") -> None:
        import torch

        self.layout = layout
        self.device = torch.device(device)
        self._mults = torch.tensor(_signed64(layout.multipliers), dtype=torch.int64).to(self.device)
        self._sizes = torch.tensor(layout.sizes, dtype=torch.int64).to(self.device)
        self._offsets = torch.tensor(layout.offsets, dtype=torch.int64).to(self.device)

    def __call__(
        self,
        input_ids: Any,
        query_start_loc: Any,
        ngram_context: Any,
        *,
        out: Any = None,
    ) -> Any:
        """Ids for a flat step of tokens.

        Args:
            input_ids: ``[T]`` tokens of all requests, request after request (padding
                tokens at the end count as the last request's).
            query_start_loc: ``[R + 1]`` start of each request in ``input_ids``.
            ngram_context: ``[>= R, ngram_size - 1]`` the tokens before each request's
                first token in this step, oldest first (EOS where there are none).
            out: optional ``int64 [T, heads]`` destination (contiguous).
        """
        import torch

        lay = self.layout
        ctx_len = lay.ngram_size - 1
        tokens = input_ids.reshape(-1).to(torch.int64)
        starts = query_start_loc.to(torch.int64)
        context = ngram_context.to(torch.int64)
        n = tokens.shape[0]
        pos = torch.arange(n, device=tokens.device, dtype=torch.int64)
        last_req = starts.shape[0] - 2
        req = (torch.searchsorted(starts, pos, right=True) - 1).clamp(0, last_req)
        col = pos - starts[req]

        mixed = tokens * self._mults[0]
        per_ngram = []
        crossed = torch.zeros_like(tokens, dtype=torch.bool)
        for shift in range(1, ctx_len + 1):
            in_step = col >= shift
            from_step = tokens[(pos - shift).clamp_min(0)]
            from_ctx = context[req, (col + ctx_len - shift).clamp(0, ctx_len - 1)]
            prev = torch.where(in_step, from_step, from_ctx).masked_fill(crossed, lay.eos_token_id)
            crossed = crossed | (prev == lay.eos_token_id)
            mixed = mixed ^ (prev * self._mults[shift])
            per_ngram.append(mixed)  # the hash of the (shift + 1)-gram
        # [T, n-grams] -> [T, heads]: each n-gram's hash for its heads (a view, no sync).
        hashes = (
            torch.stack(per_ngram, dim=1)
            .unsqueeze(-1)
            .expand(n, ctx_len, lay.heads_per_ngram)
            .reshape(n, lay.heads)
        )
        ids = torch.remainder(hashes, self._sizes) + self._offsets
        if out is None:
            return ids
        out.copy_(ids)
        return out
