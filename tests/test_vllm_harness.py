"""The engine tests' token oracle (``tests/vllm_harness.py``): tokens compared up to
a request's first difference, which must be a near tie of the reference's, and enough of
them compared (the GPU engine tests rely on it; here it runs without vLLM or a GPU)."""

from __future__ import annotations

import pytest
from vllm_harness import NEAR_TIE, Greedy, assert_same_greedy

DECISIVE = 10 * NEAR_TIE


def _reference(gaps: list[float]) -> Greedy:
    # One batch of two requests: [1, 2, 3, 4] with the given gaps, [5, 6] decisive.
    return Greedy([[[1, 2, 3, 4], [5, 6]]], [[gaps, [DECISIVE, DECISIVE]]])


def test_equal_tokens_pass() -> None:
    assert_same_greedy(_reference([DECISIVE] * 4), [[[1, 2, 3, 4], [5, 6]]])


def test_a_difference_at_a_decisive_choice_fails_naming_the_request() -> None:
    with pytest.raises(AssertionError, match=r"batch 0 request 0: from token 2 .*\[9, 4\]"):
        assert_same_greedy(_reference([DECISIVE] * 4), [[[1, 2, 9, 4], [5, 6]]])


def test_a_difference_at_a_near_tie_passes_and_later_tokens_are_not_compared() -> None:
    near = NEAR_TIE / 2
    assert_same_greedy(_reference([DECISIVE, DECISIVE, near, DECISIVE]), [[[1, 2, 9, 8], [5, 6]]])


def test_too_few_tokens_compared_fails() -> None:
    near = NEAR_TIE / 2
    with pytest.raises(AssertionError, match="only 2 of 6 tokens compared"):
        assert_same_greedy(_reference([near] * 4), [[[9, 9, 9, 9], [5, 6]]])
