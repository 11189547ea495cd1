"""Majority voting over extracted answers (self-consistency, Wang et al. 2022)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Vote:
    """The outcome of one majority vote.

    answer: the winning answer, or None when no sample gave one.
    counts: answer -> votes, in order of first appearance (None answers are not counted).
    agreement: votes for the winner / num_valid, in [0, 1]; 0 when num_valid is 0.
    num_valid: how many answers were not None.
    """

    answer: str | None
    counts: dict[str, int]
    agreement: float
    num_valid: int


def majority_vote(answers: Sequence[str | None]) -> Vote:
    """The most common non-None answer.

    None (no answer extracted) abstains rather than voting for "no answer": a sample that failed
    to finish should not outvote the ones that did. Ties go to the answer that appeared FIRST in
    `answers`, which makes the result deterministic and, when samples are listed in the order
    they were drawn, independent of how the tie would hash.
    """
    counts: dict[str, int] = {}
    for answer in answers:
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
    num_valid = sum(counts.values())
    if not counts:
        return Vote(answer=None, counts={}, agreement=0.0, num_valid=0)
    # max() keeps the first maximal item and dicts keep insertion order: first appearance wins.
    winner = max(counts, key=counts.__getitem__)
    return Vote(
        answer=winner, counts=counts, agreement=counts[winner] / num_valid, num_valid=num_valid
    )
