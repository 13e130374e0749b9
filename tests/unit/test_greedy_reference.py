"""The near-tie comparator accepts only the reference's own near-ties (greedy_reference.py)."""

from __future__ import annotations

import pytest
import torch

from tests.greedy_reference import NEAR_TIE, NearTieWarning, compare_greedy

CLEAR = torch.tensor([0.0, 5.0, 1.0])  # token 1 wins by 4
TIED = torch.tensor([1.0, 1.0 + NEAR_TIE / 4, 0.0])  # tokens 1 and 0 within NEAR_TIE


def test_equal_outputs_pass_without_a_report() -> None:
    assert compare_greedy([1, 1], [1, 1, 2], [CLEAR, TIED, CLEAR], "eq") is None


def test_a_near_tie_is_accepted_and_reported() -> None:
    with pytest.warns(NearTieWarning):
        tie = compare_greedy([1, 0, 7], [1, 1, 2], [CLEAR, TIED, CLEAR], "tie")
    assert tie is not None and tie.position == 1 and tie.gap < NEAR_TIE


@pytest.mark.parametrize(
    "got, logits",
    [([0, 1], [CLEAR, TIED]), ([1, 2], [CLEAR, TIED])],  # a clear winner; a third token at a tie
    ids=["clear-winner", "not-in-top-2"],
)
def test_a_real_difference_fails(got: list[int], logits: list[torch.Tensor]) -> None:
    with pytest.raises(AssertionError):
        compare_greedy(got, [1, 1], logits, "bad")


def test_a_longer_output_fails() -> None:
    with pytest.raises(AssertionError, match="reference made"):
        compare_greedy([1, 1, 1], [1, 1], [CLEAR, CLEAR], "long")
