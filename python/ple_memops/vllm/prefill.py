"""A step's row ids, computed on the host before the GPU publishes them.

Under async scheduling the host prepares step N+1 while the GPU runs step N, and the
row ids of a step are computed by the forward on the GPU: a worker can gather a layer's
rows only once the forward reached that layer's ids. For a prefill chunk the host knows
the tokens already (they are the prompt's, or a resumed request's tokens so far), so with
the model's id function it can compute the same ids and arm the step with them
(:meth:`~ple_memops.vllm.hooks.PleRunnerHooks.expect`): each worker then gathers those rows
while the GPU still runs step N. A decode token is sampled on the GPU by the step
before; once that step has finished on the GPU (the host is behind it, as at high
concurrency, where the host paces the engine) vLLM's ``all_token_ids``, which the GPU
writes into pinned host memory, holds it, and the host computes its ids too
(``expect_decode``). Tokens the host cannot know (a decode token whose step still runs,
speculative drafts) are left ``-1`` and gathered when the forward publishes, as before.
The published ids always decide the rows (see :meth:`ple_memops.GatherWorker.begin`), so
an expectation that is wrong costs time, never a row.

:class:`PrefillExpectations` keeps each request's known tokens by its row in vLLM's
request state (:meth:`add`, from the new requests of a step) and builds a step's
expectations from the batch's arrays (:meth:`step`). No torch, no vLLM: the runner
(:mod:`.runner`) feeds it vLLM's ``BatchReqState`` fields.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ..errors import InvalidArgumentError

__all__ = [
    "HostIds",
    "HostTokenIds",
    "PrefillExpectations",
    "as_int64",
    "history_array",
    "request_chunks",
]


def as_int64(values: Any, what: str) -> np.ndarray:
    """``values`` (a sequence, an array, a CPU tensor) as a C-contiguous int64 array;
    a CUDA tensor or non-integers raise :class:`~ple_memops.InvalidArgumentError` naming
    ``what``."""
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.flags.c_contiguous:
        return values  # the common case, per step: nothing to check or copy
    if hasattr(values, "is_cuda") and values.is_cuda:
        raise InvalidArgumentError(f"{what} must be on the host, not a CUDA tensor")
    if hasattr(values, "numpy"):
        values = values.numpy()
    arr = np.asarray(values)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgumentError(f"{what} must hold integers, not {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def request_chunks(
    token_ids: Sequence[Any], computed: Sequence[int], scheduled: Sequence[int]
) -> list[tuple[np.ndarray, int, int]]:
    """Each request's tokens (int64) with its chunk's start and length, checked: request
    ``r``'s ``scheduled[r]`` tokens from position ``computed[r]`` of ``token_ids[r]``."""
    if not len(token_ids) == len(computed) == len(scheduled):
        raise InvalidArgumentError(
            f"{len(token_ids)} token lists, {len(computed)} computed counts and "
            f"{len(scheduled)} scheduled counts"
        )
    out = []
    for r, (toks, start, count) in enumerate(zip(token_ids, computed, scheduled, strict=True)):
        arr = as_int64(toks, f"token_ids[{r}]").reshape(-1)
        start, count = int(start), int(count)
        if start < 0 or count < 0 or start + count > arr.size:
            raise InvalidArgumentError(
                f"request {r}: tokens [{start}, {start + count}) of a {arr.size}-token request"
            )
        out.append((arr, start, count))
    return out


class HostIds(Protocol):
    """A layer's ids on the host (:class:`~ple_memops.vllm.ngram_ids.HostNGramIds`):
    :meth:`inputs` builds a step's arrays from its request chunks, calling the object
    on them gives ``int64 [tokens, ids_per_token]``; layers with equal ``inputs_key``
    share the arrays. :meth:`ids_at` gives one token a request read from a token history
    (a decode step's)."""

    @property
    def inputs_key(self) -> Hashable: ...

    def inputs(
        self, token_ids: Sequence[Any], computed: Sequence[int], scheduled: Sequence[int]
    ) -> tuple[Any, ...]: ...

    def __call__(self, *inputs: Any) -> np.ndarray: ...

    def ids_at(self, history: np.ndarray, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``int64 [len(rows), ids_per_token]``: the ids of request ``i``'s token at
        ``positions[i]`` of ``history`` row ``rows[i]`` (``int32 [requests, width]``,
        C-contiguous: vLLM's ``all_token_ids``), with the tokens before it."""
        ...


def history_array(history: Any) -> np.ndarray:
    """``history`` as the C-contiguous ``int32 [requests, width]`` array it must be (vLLM's
    ``all_token_ids`` as the host sees it: never copied, it can be gigabytes); anything
    else raises :class:`~ple_memops.InvalidArgumentError`."""
    hist = np.asarray(history)
    if hist.ndim != 2 or hist.dtype != np.int32 or not hist.flags.c_contiguous:
        raise InvalidArgumentError(
            f"history must be a C-contiguous int32 [requests, positions] array, not "
            f"{hist.dtype} {hist.shape}"
        )
    return hist


class HostTokenIds:
    """Gemma's per-layer table ids on the host: a token's id is its row, and a token
    outside the table (``< 0`` or ``>= vocab``) reads row 0, as vLLM's Gemma 4 and Gemma 3n
    mask them. One id a token. (The multimodal classes also read row 0 at image and audio
    positions; the host expects the placeholder's own id there, so those rows count as
    expected wrongly and are gathered at the publish: right, only later.)"""

    def __init__(self, vocab: int) -> None:
        if vocab < 1:
            raise InvalidArgumentError(f"a table of {vocab} rows")
        self.vocab = int(vocab)

    @property
    def inputs_key(self) -> Hashable:
        return ("tokens",)

    def inputs(
        self, token_ids: Sequence[Any], computed: Sequence[int], scheduled: Sequence[int]
    ) -> tuple[np.ndarray]:
        """The step's tokens: request ``r``'s ``scheduled[r]`` from ``computed[r]``."""
        chunks = [a[s : s + n] for a, s, n in request_chunks(token_ids, computed, scheduled)]
        return (np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64),)

    def __call__(self, tokens: Any) -> np.ndarray:
        """``int64 [tokens, 1]``: each token's row."""
        t = np.asarray(tokens, dtype=np.int64).reshape(-1)
        return np.where((t >= 0) & (t < self.vocab), t, 0).reshape(-1, 1)

    def ids_at(self, history: np.ndarray, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Each request's token at ``positions[i]`` of ``history`` row ``rows[i]``, as
        :meth:`__call__` maps it."""
        hist = history_array(history)
        return self(hist[np.asarray(rows, dtype=np.int64), np.asarray(positions, dtype=np.int64)])


class PrefillExpectations:
    """Per PLE layer (by the plan's name) what computes its ids on the host
    (:class:`HostIds`), ``ids_per_token`` ids a token. Thread-compatible (the runner's
    thread)."""

    def __init__(self, layers: Mapping[str, HostIds], ids_per_token: int) -> None:
        if not layers:
            raise InvalidArgumentError("no layers to expect ids for")
        if ids_per_token < 1:
            raise InvalidArgumentError(f"ids_per_token must be >= 1, got {ids_per_token}")
        self.layers = dict(layers)
        self.ids_per_token = int(ids_per_token)
        self._tokens: dict[int, np.ndarray] = {}
        self.steps = 0
        """Steps given expectations by :meth:`step`."""
        self.decode_rows = 0
        """Decode tokens given expectations from ``history`` by :meth:`step`."""

    def add(self, row: int, token_ids: Sequence[int] | np.ndarray) -> None:
        """Request state row ``row`` now holds a request whose tokens so far (its prompt,
        or a resumed request's prompt and outputs) are ``token_ids``: what vLLM's
        ``RequestState.add_request`` receives. Replaces what the row held."""
        self._tokens[int(row)] = np.asarray(token_ids, dtype=np.int64).reshape(-1)

    def drop(self, row: int) -> None:
        """Forget row ``row`` (its request finished or was preempted)."""
        self._tokens.pop(int(row), None)

    def step(
        self,
        rows: np.ndarray,
        computed: np.ndarray,
        scheduled: np.ndarray,
        prefill_len: np.ndarray,
        *,
        positions: np.ndarray | None = None,
        history: np.ndarray | None = None,
        tokens: int | None = None,
    ) -> dict[str, np.ndarray] | None:
        """A step's expectations: its requests in batch order (their request state
        ``rows``, tokens already ``computed``, tokens ``scheduled`` now, and
        ``prefill_len``, the tokens known before the request's first output); returns per
        layer ``int64 [sum(scheduled) * ids_per_token]``, ``-1`` for every token the host
        does not know, or ``None`` when it knows none.

        A token inside a known prefill (a row :meth:`add`-ed) is known. A decode token
        (one token scheduled, at or past ``prefill_len``) is known from ``history``
        when given: vLLM's ``all_token_ids`` as the host sees it (``[rows, positions]``),
        each request's token at ``positions[i]`` (its computed tokens, as the scheduler
        counts them) and the ones before it. The caller must know those entries are
        written: the step that sampled them has finished on the GPU. Other tokens
        (drafts, a row never added, a position outside ``history``) stay ``-1``.
        ``tokens``: the forward's tokens when more than scheduled (a FULL graph's padded
        batch): the arrays then cover them, ``-1`` past the scheduled ones."""
        rows = np.asarray(rows).reshape(-1)
        computed = np.asarray(computed).reshape(-1)
        scheduled = np.asarray(scheduled).reshape(-1)
        prefill_len = np.asarray(prefill_len).reshape(-1)
        if not (rows.size == computed.size == scheduled.size == prefill_len.size):
            raise InvalidArgumentError(
                f"{rows.size} rows, {computed.size} computed, {scheduled.size} scheduled and "
                f"{prefill_len.size} prefill lengths"
            )
        starts = np.zeros(rows.size + 1, dtype=np.int64)
        np.cumsum(scheduled, out=starts[1:])
        size = int(starts[-1]) if tokens is None else max(int(tokens), int(starts[-1]))
        known: list[int] = []
        # Only chunks inside their prefill can be known (a decode step has none: no loop).
        inside = (scheduled > 0) & (computed + scheduled <= prefill_len)
        for i in np.flatnonzero(inside).tolist() if self._tokens else ():
            have = self._tokens.get(int(rows[i]))
            if have is not None and int(computed[i]) + int(scheduled[i]) <= have.size:
                known.append(i)
        hist = None if history is None else history_array(history)
        decode = self._decode_rows(rows, scheduled, prefill_len, positions, hist, known)
        if not known and decode is None:
            return None
        h = self.ids_per_token
        toks = [self._tokens[int(rows[i])] for i in known]
        at = [int(computed[i]) for i in known]
        count = [int(scheduled[i]) for i in known]
        out: dict[str, np.ndarray] = {}
        shared: dict[Hashable, tuple[Any, ...]] = {}  # one step's arrays for every layer
        for name, ids_of in self.layers.items():
            flat = np.full(size * h, -1, dtype=np.int64)
            if known:
                key = ids_of.inputs_key
                if key not in shared:
                    shared[key] = ids_of.inputs(toks, at, count)
                ids = self._checked(name, ids_of(*shared[key]), sum(count))
                done = 0
                for i, n in zip(known, count, strict=True):
                    a = int(starts[i]) * h
                    flat[a : a + n * h] = ids[done : done + n].reshape(-1)
                    done += n
            if decode is not None and hist is not None:
                which, at_rows, at_positions = decode
                ids = ids_of.ids_at(hist, at_rows, at_positions)
                flat.reshape(-1, h)[starts[which]] = self._checked(name, ids, which.size)
            out[name] = flat
        self.steps += 1
        if decode is not None:
            self.decode_rows += int(decode[0].size)
        return out

    def _checked(self, name: str, ids: Any, tokens: int) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.shape != (tokens, self.ids_per_token):
            raise InvalidArgumentError(
                f"{name}: the host ids have shape {arr.shape}, not ({tokens}, {self.ids_per_token})"
            )
        return arr

    def _decode_rows(
        self,
        rows: np.ndarray,
        scheduled: np.ndarray,
        prefill_len: np.ndarray,
        positions: np.ndarray | None,
        history: np.ndarray | None,
        known: list[int],
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The batch indices of the decode tokens ``history`` gives, with their history
        rows and positions (``int64``); ``None`` when there are none."""
        if history is None or positions is None:
            return None
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if positions.size != rows.size:
            raise InvalidArgumentError(f"{positions.size} positions for {rows.size} rows")
        n_rows, width = history.shape
        cand = (scheduled == 1) & (positions >= prefill_len) & (positions < width)
        cand &= (rows >= 0) & (rows < n_rows)
        cand[known] = False
        which = np.flatnonzero(cand)
        if not which.size:
            return None
        return which, rows[which].astype(np.int64), positions[which]
