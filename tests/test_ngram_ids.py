"""Qwen4Exp's n-gram ids on the host (:class:`ple_memops.vllm.ngram_ids.HostNGramIds`)
against the hash written out in plain Python integers, and its typed refusals. No vLLM
needed; ``test_vllm_real.py`` checks it against vLLM's own ``compute_ngram_ids``."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ple_memops.errors import InvalidArgumentError, PleMemopsError
from ple_memops.vllm.ngram_ids import HostNGramIds

EOS = 2
M64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= M64
    return x - (1 << 64) if x >> 63 else x


def _hash(seed: int = 3) -> HostNGramIds:
    rng = random.Random(seed)
    mult = [_signed(rng.getrandbits(64) | 1) for _ in range(3)]
    sizes = [1_000_003, 999_983, 1_000_033, 7]
    offsets = [0, 1_000_003, 1_999_986, 3_000_019]
    return HostNGramIds(
        multipliers=np.array(mult, dtype=np.int64),
        sizes=np.array(sizes, dtype=np.int64),
        offsets=np.array(offsets, dtype=np.int64),
        eos_token_id=EOS,
        ngram_size=3,
        heads_per_ngram=2,
    )


def _reference(h: HostNGramIds, row: list[int], context: list[int]) -> list[list[int]]:
    """One request: its context then its tokens, walked in Python integers."""
    seq = list(context) + list(row)
    c = h.ngram_size - 1
    out = []
    for t in range(c, len(seq)):
        last_eos = max((i for i in range(t) if seq[i] == EOS), default=-1)

        def back(k: int, t: int = t, last_eos: int = last_eos) -> int:
            return seq[t - k] if t - k > last_eos else EOS

        ids = []
        for n in range(2, h.ngram_size + 1):
            mixed = 0
            for k in range(n):
                mixed ^= (back(k) * int(h.multipliers[k])) & M64
            mixed = _signed(mixed)
            for j in range(h.heads_per_ngram):
                head = (n - 2) * h.heads_per_ngram + j
                ids.append(int(h.offsets[head]) + mixed % int(h.sizes[head]))
        out.append(ids)
    return out


def test_ids_are_the_hash_written_out() -> None:
    h = _hash()
    rng = random.Random(8)
    for _ in range(200):
        rows = [
            [
                rng.choice([EOS, rng.randint(0, 50), rng.randint(0, 1 << 40)])
                for _ in range(rng.randint(0, 7))
            ]
            for _ in range(rng.randint(1, 4))
        ]
        ctx = [[rng.choice([EOS, rng.randint(0, 50)]) for _ in range(2)] for _ in rows]
        qsl = np.cumsum([0] + [len(r) for r in rows])
        toks = np.array([t for r in rows for t in r], dtype=np.int64)
        got = h(toks, qsl, np.array(ctx))
        want = [ids for r, c in zip(rows, ctx, strict=True) for ids in _reference(h, r, c)]
        assert got.shape == (len(toks), h.heads)
        assert got.tolist() == want


def test_chunks_of_a_prompt_get_the_prompts_ids() -> None:
    h = _hash()
    prompt = [5, 9, EOS, 11, 12, 13, EOS, EOS, 4, 8, 15, 16]
    whole = h.for_requests([prompt], [0], [len(prompt)])
    for start in range(len(prompt)):
        for count in range(1, len(prompt) - start + 1):
            got = h.for_requests([prompt, prompt], [start, 0], [count, 1])
            assert got[:count].tolist() == whole[start : start + count].tolist()
            assert got[count:].tolist() == whole[:1].tolist()


def test_refusals_are_typed_and_name_the_argument() -> None:
    h = _hash()
    with pytest.raises(InvalidArgumentError, match="query_start_loc"):
        h(np.arange(4), np.array([0, 5]), np.zeros((1, 2), dtype=np.int64))
    with pytest.raises(InvalidArgumentError, match="query_start_loc"):
        h(np.arange(4), np.array([1, 3]), np.zeros((1, 2), dtype=np.int64))
    with pytest.raises(InvalidArgumentError, match="ngram_context has 1 rows"):
        h(np.arange(4), np.array([0, 2, 4]), np.zeros((1, 2), dtype=np.int64))
    with pytest.raises(InvalidArgumentError, match="must hold integers"):
        h(np.array([1.5, 2.0]), np.array([0, 2]), np.zeros((1, 2), dtype=np.int64))
    with pytest.raises(InvalidArgumentError, match=r"tokens \[3, 6\) of a 4-token request"):
        h.for_requests([[1, 2, 3, 4]], [3], [3])
    with pytest.raises(InvalidArgumentError, match="2 token lists, 1 computed"):
        h.for_requests([[1], [2]], [0], [1, 1])
    with pytest.raises(InvalidArgumentError, match="multipliers for ngram_size 3"):
        HostNGramIds(np.zeros(2, np.int64), h.sizes, h.offsets, EOS, 3, 2)
    with pytest.raises(PleMemopsError, match="no 'layer_multipliers'"):
        HostNGramIds.from_module(object())
    assert h(np.zeros(0, np.int64), np.array([0, 0]), np.zeros((1, 2), np.int64)).shape == (0, 4)


def test_a_mixed_steps_expectations_cover_its_known_prefills_only() -> None:
    """A step of a decode, a prefill chunk of a known prompt, a prefill of a row never
    added (no tokens known), a chunk ending the prompt, and a resumed request past its
    prefill: ids where the host knows the tokens, ``-1`` elsewhere, in batch order."""
    from ple_memops.vllm.prefill import PrefillExpectations

    h, h2 = _hash(), _hash(4)  # two layers: one step's inputs, each its own multipliers
    exp = PrefillExpectations({"a": h, "b": h2}, h.heads)
    prompts = {3: [5, 9, EOS, 11, 12, 13, 14], 7: [8, 8, 8, 8], 9: [1, 2, 3]}
    for row, toks in prompts.items():
        exp.add(row, toks)
    rows = np.array([3, 7, 4, 9, 3])
    computed = np.array([7, 1, 0, 1, 2])  # row 3 first as a decode (7 >= its 7 tokens)
    scheduled = np.array([1, 2, 5, 2, 3])
    prefill_len = np.array([7, 4, 5, 3, 7])
    got = exp.step(rows, computed, scheduled, prefill_len)
    assert got is not None and set(got) == {"a", "b"} and exp.steps == 1
    H = h.heads
    for name, layer in (("a", h), ("b", h2)):
        want = np.full(sum(scheduled) * H, -1, dtype=np.int64)
        want[1 * H : 3 * H] = layer.for_requests([prompts[7]], [1], [2]).reshape(-1)
        want[8 * H : 10 * H] = layer.for_requests([prompts[9]], [1], [2]).reshape(-1)
        want[10 * H : 13 * H] = layer.for_requests([prompts[3]], [2], [3]).reshape(-1)
        assert got[name].tolist() == want.tolist(), name
    assert got["a"].tolist() != got["b"].tolist()
    # A row dropped, decodes only: nothing known.
    exp.drop(7)
    assert exp.step(np.array([7, 3]), np.array([1, 7]), np.array([1, 1]), np.array([4, 7])) is None
    with pytest.raises(InvalidArgumentError, match="2 rows, 1 computed"):
        exp.step(np.array([1, 2]), np.array([0]), np.array([1, 1]), np.array([1, 1]))

    class Short(HostNGramIds):
        def __call__(self, *inputs: object) -> np.ndarray:
            return np.zeros((1, 1), np.int64)

    short = Short(h.multipliers, h.sizes, h.offsets, EOS, 3, 2)
    bad = PrefillExpectations({"a": short}, h.heads)
    bad.add(0, [1, 2])
    with pytest.raises(InvalidArgumentError, match=r"a: the host ids have shape \(1, 1\)"):
        bad.step(np.array([0]), np.array([0]), np.array([2]), np.array([2]))


def test_gemma_token_ids_read_row_0_outside_the_table() -> None:
    """Gemma's host ids: a token's own row, row 0 for ids outside the table; in a step's
    expectations one id a token, -1 for decodes."""
    from ple_memops.vllm.prefill import HostTokenIds, PrefillExpectations

    ids = HostTokenIds(100)
    assert ids(*ids.inputs([[5, -1, 99, 100, 7]], [1], [4])).tolist() == [[0], [99], [0], [7]]
    exp = PrefillExpectations({"t": ids}, 1)
    exp.add(0, [3, 4, 500])
    got = exp.step(np.array([1, 0]), np.array([9, 1]), np.array([1, 2]), np.array([5, 3]))
    assert got is not None and got["t"].tolist() == [-1, 4, 0]
    with pytest.raises(InvalidArgumentError, match="a table of 0 rows"):
        HostTokenIds(0)


def test_decode_tokens_are_expected_from_the_token_history() -> None:
    """``expect_decode``: a decode token's ids from vLLM's ``all_token_ids`` as the host
    sees it (``history[row, position]``), the ids of its whole sequence's last token:
    with an EOS in its window, at position 0 and 1 (EOS before the start), beside a
    known prefill chunk, a draft-like row of two tokens and a row whose position lies
    past the history (both ``-1``)."""
    from ple_memops.vllm.prefill import HostTokenIds, PrefillExpectations

    rng = random.Random(5)
    h, h2 = _hash(), _hash(6)
    exp = PrefillExpectations({"a": h, "b": h2}, h.heads)
    history = np.zeros((8, 12), dtype=np.int32)  # vLLM's all_token_ids: int32
    seqs = {
        1: [rng.randint(0, 50) for _ in range(9)],
        2: [4, 5, EOS, 6, 7],
        3: [17],
        5: [9, 10],
        6: [rng.randint(0, 50) for _ in range(12)],
    }
    for row, toks in seqs.items():
        history[row, : len(toks)] = toks
    exp.add(4, [3, 1, 4, 1, 5])
    # Decode rows 1, 2, 3, 5 at their last token, a chunk of row 4's prompt, a row
    # with two tokens (drafts) and row 6 at a position outside the history.
    rows = np.array([1, 4, 2, 3, 5, 0, 6])
    positions = np.array([8, 0, 4, 0, 1, 3, 12])
    computed = np.array([1, 1, 1, 0, 1, 2, 12])  # what vLLM's prefill counters hold
    scheduled = np.array([1, 3, 1, 1, 1, 2, 1])
    prefill_len = np.array([1, 5, 1, 0, 1, 1, 12])
    got = exp.step(rows, computed, scheduled, prefill_len, positions=positions, history=history)
    assert got is not None and exp.decode_rows == 4
    H = h.heads
    starts = np.concatenate(([0], np.cumsum(scheduled)))
    for name, layer in (("a", h), ("b", h2)):
        want = np.full(int(starts[-1]) * H, -1, dtype=np.int64)
        for i in (0, 2, 3, 4):
            seq = seqs[int(rows[i])][: positions[i] + 1]
            ids = _reference(layer, seq, [EOS] * (layer.ngram_size - 1))[-1]
            want[starts[i] * H : (starts[i] + 1) * H] = ids
        chunk = layer.for_requests([[3, 1, 4, 1, 5]], [1], [3])
        want[starts[1] * H : starts[2] * H] = chunk.reshape(-1)
        assert got[name].tolist() == want.tolist(), name
    # A FULL graph's padded batch: the arrays cover its tokens, -1 past the scheduled ones.
    padded = exp.step(
        rows, computed, scheduled, prefill_len, positions=positions, history=history, tokens=16
    )
    assert padded is not None and padded["a"].size == 16 * H
    assert padded["a"][: got["a"].size].tolist() == got["a"].tolist()
    assert (padded["a"][got["a"].size :] == -1).all()
    # Without a history, the decode tokens stay unknown, as before.
    plain = exp.step(rows, computed, scheduled, prefill_len)
    assert plain is not None and (plain["a"][:H] == -1).all()
    with pytest.raises(InvalidArgumentError, match="3 positions for 7 rows"):
        exp.step(rows, computed, scheduled, prefill_len, positions=positions[:3], history=history)
    with pytest.raises(InvalidArgumentError, match="history must be"):
        exp.step(rows, computed, scheduled, prefill_len, positions=positions, history=history[0])
    # Gemma's ids: the token itself, no context.
    tok = PrefillExpectations({"t": HostTokenIds(100)}, 1)
    got = tok.step(
        np.array([1, 2]),
        np.array([1, 1]),
        np.array([1, 1]),
        np.array([1, 1]),
        positions=np.array([3, 1]),
        history=history,
    )
    assert got is not None and got["t"].tolist() == [seqs[1][3], 5]
