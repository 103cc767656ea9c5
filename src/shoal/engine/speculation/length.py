"""How many tokens to guess for one request: the count that buys the most tokens per second.

A step that verifies k guesses costs more than a plain decode step (k more rows through
every layer, off the fused decode kernel): StepCosts keeps what such steps measured on this
engine, relative to a plain step. If each guess is kept with probability a (given the ones
before it were), a step with k guesses yields (1 - a^(k+1)) / (1 - a) tokens on average;
DraftLength estimates a from the request's recent verifications and picks the k with the
best tokens per unit of cost. When no k beats a plain step, speculation rests for a while
(twice as long after each failed try, up to MAX_REST steps), then tries again. Guesses from
a Proposer (a draft model, a proposer node) count their wait in the step's cost
(Speculator.observe_step), so dear guesses buy fewer of them.
"""

from __future__ import annotations

# Until measured, a step verifying k guesses is taken to cost 1 + PRIOR_ROW_COST * k plain
# steps (this CPU measured 1.4x for one guess, 2.3x for four, 2.9x for twelve on a 1.5B
# model).
PRIOR_ROW_COST = 0.35
COST_MEMORY = 0.8      # weight of the previous estimate in each new cost average
KEPT_MEMORY = 0.7      # how fast a request's acceptance estimate forgets old steps
PRIOR_KEPT, PRIOR_MISSED = 3.0, 0.5  # a fresh (or rested) request's hopeful start
FIRST_REST = 8         # plain steps after the first time guessing did not pay
MAX_REST = 256


class StepCosts:
    """Seconds per step by how many guesses it verified (for steps of one request)."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    def observe(self, guesses: int, seconds: float) -> None:
        old = self._seconds.get(guesses)
        self._seconds[guesses] = seconds if old is None else \
            COST_MEMORY * old + (1 - COST_MEMORY) * seconds

    def relative(self, guesses: int) -> float:
        """Cost of a step verifying `guesses` guesses, in plain decode steps."""
        plain = self._seconds.get(0)
        seconds = self._seconds.get(guesses)
        if guesses == 0:
            return 1.0
        if plain is None or seconds is None:
            return 1.0 + PRIOR_ROW_COST * guesses
        return seconds / plain


def expected_tokens(kept_rate: float, guesses: int) -> float:
    """Mean tokens a step yields: the kept run of guesses plus the model's own token."""
    if kept_rate >= 1.0:
        return guesses + 1.0
    return (1.0 - kept_rate ** (guesses + 1)) / (1.0 - kept_rate)


class DraftLength:
    def __init__(self, most: int, costs: StepCosts) -> None:
        self.most = most
        self._costs = costs
        self._kept = PRIOR_KEPT
        self._missed = PRIOR_MISSED
        self._rest = FIRST_REST
        self._resting = 0

    @property
    def kept_rate(self) -> float:
        return self._kept / (self._kept + self._missed)

    def wanted(self) -> int:
        """Guesses to ask for this step; 0 while resting or when none would pay."""
        if self._resting > 0:
            self._resting -= 1
            if self._resting == 0:  # try again with fresh hopes
                self._kept, self._missed = PRIOR_KEPT, PRIOR_MISSED
            return 0
        rate = self.kept_rate
        best, best_value = 0, 1.0
        for guesses in range(1, self.most + 1):
            value = expected_tokens(rate, guesses) / self._costs.relative(guesses)
            if value > best_value:
                best, best_value = guesses, value
        if best == 0:
            self._resting = self._rest
            self._rest = min(MAX_REST, self._rest * 2)
        return best

    def record(self, proposed: int, kept: int) -> None:
        """One verification: `kept` of `proposed` guesses agreed with the model."""
        if proposed == 0:
            return
        self._kept = KEPT_MEMORY * self._kept + kept
        self._missed = KEPT_MEMORY * self._missed + (1.0 if kept < proposed else 0.0)
        if kept == proposed:
            self._rest = FIRST_REST
