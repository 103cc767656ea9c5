"""Where guesses come from when they are not the request's own n-grams: a draft model in
this process, or a proposer on another node. The engine's Speculator asks a Proposer for up
to k tokens before each step and verifies whatever comes back, so a proposer can only make
guessing pay less, never change a token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]   # the guessed continuation (k tokens, or fewer, or none)
    probs: list[float]  # the proposer's probability of each guessed token (1.0 for n-grams)


class Proposer(Protocol):
    def propose(self, request_id: str, context: Sequence[int], k: int) -> Proposal | None:
        """context: the request's whole token sequence so far (prompt + kept outputs).
        Implementations hand on only what the far side lacks (the new suffix, and the
        point to cut back to where earlier guesses were rejected). None: no proposal in
        time."""

    def forget(self, request_id: str) -> None:
        """The request is over: drop its state."""


def common_prefix(held: Sequence[int], context: Sequence[int]) -> int:
    """How many leading tokens the proposer's copy of a request shares with the context."""
    same = 0
    for a, b in zip(held, context):
        if a != b:
            break
        same += 1
    return same
