"""Which guessed tokens to keep, given what the target model sampled after each of them.

A step that verifies drafts d_1..d_k computes the target's distribution p_j at each of the
k + 1 positions (after the last kept token, after d_1, ..., after d_k) and samples x_j ~ p_j
with the request's full sampler (penalties, bias, temperature, top-k/p, min-p; greedy is the
argmax). The kept tokens are d_1..d_a, where a is the first j with x_{j+1} != d_{j+1}, then
x_{a+1}: the target's own token at the first disagreement, or a bonus token when all agree.

For guesses that are a deterministic function of the context (n-gram lookup, a greedy draft
model), this is exactly the probability-ratio rule of Leviathan et al. 2023 and Chen et al.
2023 with a one-hot draft distribution q = δ(d): d is accepted with probability
min(1, p(d) / q(d)) = p(d), and on rejection the residual max(p - q, 0), renormalised, is p
with d removed, which is the law of x given x != d. So every kept token has exactly the
target's distribution, and greedy output is the target's argmax at every position.
"""

from __future__ import annotations

from collections.abc import Sequence


def kept_tokens(drafts: Sequence[int], samples: Sequence[int]) -> list[int]:
    """drafts: k guesses; samples: the target's k + 1 draws (one per position). Returns the
    accepted drafts followed by one token of the target's (1 .. k + 1 tokens)."""
    if len(samples) != len(drafts) + 1:
        raise ValueError(f"{len(samples)} samples for {len(drafts)} drafts")
    accepted = 0
    while accepted < len(drafts) and samples[accepted] == drafts[accepted]:
        accepted += 1
    return list(drafts[:accepted]) + [samples[accepted]]
