"""What the engine asks of a source of guesses that is not its own n-gram index: a
Proposer (a draft model in this process, or a proposer on another node: remote.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]          # k guessed tokens (may be fewer, or empty)
    probs: list[float]         # the proposer's probability of each token (1.0 for n-gram)


class Proposer(Protocol):
    def propose(self, request_id: str, context: Sequence[int], k: int) -> Proposal | None:
        """context: the request's whole token sequence so far (prompt + kept outputs).
        Implementations send only what the far side lacks (the new suffix, and the point
        to cut back to if earlier tokens changed). None: no proposal in time."""

    def forget(self, request_id: str) -> None: ...


def common_prefix(held: Sequence[int], context: Sequence[int]) -> int:
    """How many leading tokens the proposer's copy of a request shares with the context."""
    same = 0
    for a, b in zip(held, context):
        if a != b:
            break
        same += 1
    return same
