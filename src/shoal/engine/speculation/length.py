"""How many tokens to guess for one request: the count that buys the most tokens per second.

A step that verifies k guesses costs more than a plain decode step (k more rows through
every layer, off the fused decode kernel): StepCosts keeps what such steps measured on this
engine, relative to a plain step. If each guess is kept with probability a (given the ones
before it were), a step with k guesses yields (1 - a^(k+1)) / (1 - a) tokens on average;
DraftLength estimates a from the request's recent verifications and picks the k with the
best tokens per unit of cost, trying k up to twice the longest measured so far. When no k
beats a plain step, speculation rests for a while (twice as long after each failed try, up
to MAX_REST steps), then tries again. Guesses from a Proposer (a draft model, a proposer
node) count their wait in the step's cost (Speculator.observe_step), so dear guesses buy
fewer of them. A Proposer's first guesses for a request cost feeding it the whole context
as well: it is asked only when the time guessing should save over the tokens the request
may still generate, at the kept rate its guesses had over recent requests, exceeds that
(Speculator, catch-up).
"""

from __future__ import annotations

# Until measured, a step verifying k guesses is taken to cost 1 + PRIOR_ROW_COST * k plain
# steps (this CPU measured 1.4x for one guess, 2.3x for four, 2.9x for twelve on a 1.5B
# model).
PRIOR_ROW_COST = 0.35
COST_MEMORY = 0.8      # weight of the previous estimate in each new cost average
KEPT_MEMORY = 0.7      # how fast a request's acceptance estimate forgets old steps
ENGINE_KEPT_MEMORY = 0.95  # the same over all requests' Proposer guesses (catch-up)
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
        """Cost of a step verifying `guesses` guesses, in plain decode steps. A count not
        measured yet is priced at the cost per guess of the nearest count measured (below
        it if any): a draft model whose one guess already costs half a step is not tried
        at ten on a prior that knows nothing of its time."""
        plain = self._seconds.get(0)
        if guesses == 0:
            return 1.0
        if plain is None:
            return 1.0 + PRIOR_ROW_COST * guesses
        seconds = self._seconds.get(guesses)
        if seconds is not None:
            return seconds / plain
        measured = [k for k in self._seconds if k > 0]
        if not measured:
            return 1.0 + PRIOR_ROW_COST * guesses
        below = [k for k in measured if k < guesses]
        nearest = max(below) if below else min(measured)
        per_guess = max(self._seconds[nearest] / plain - 1.0, 0.0) / nearest
        return 1.0 + max(per_guess, PRIOR_ROW_COST if not below else 0.0) * guesses

    def plain_seconds(self) -> float | None:
        return self._seconds.get(0)

    def largest_measured(self) -> int:
        """The most guesses a measured step verified (0: none yet, or no plain step to
        compare with)."""
        if 0 not in self._seconds:
            return 0
        return max((k for k in self._seconds if k > 0), default=0)

    def wants_plain(self) -> bool:
        """Guessing steps were measured but no plain step to price them against."""
        return 0 not in self._seconds and len(self._seconds) > 0


def expected_tokens(kept_rate: float, guesses: int) -> float:
    """Mean tokens a step yields: the kept run of guesses plus the model's own token."""
    if kept_rate >= 1.0:
        return guesses + 1.0
    return (1.0 - kept_rate ** (guesses + 1)) / (1.0 - kept_rate)


class KeptRate:
    """How often a guess is kept, given the ones before it were: kept guesses against
    verifications that rejected one, each older one weighing `memory` times less."""

    def __init__(self, memory: float) -> None:
        self._memory = memory
        self._kept = PRIOR_KEPT
        self._missed = PRIOR_MISSED

    @property
    def rate(self) -> float:
        return self._kept / (self._kept + self._missed)

    def record(self, proposed: int, kept: int) -> None:
        self._kept = self._memory * self._kept + kept
        self._missed = self._memory * self._missed + (1.0 if kept < proposed else 0.0)

    def relax(self) -> None:
        """A step back towards the hopeful start, for a time without new evidence (so a
        bad spell is not held against every later request)."""
        self._kept = self._memory * self._kept + (1 - self._memory) * PRIOR_KEPT
        self._missed = self._memory * self._missed + (1 - self._memory) * PRIOR_MISSED


class DraftLength:
    def __init__(self, most: int, costs: StepCosts) -> None:
        self.most = most
        self._costs = costs
        self._kept = KeptRate(KEPT_MEMORY)
        self._rest = FIRST_REST
        self._resting = 0

    @property
    def kept_rate(self) -> float:
        return self._kept.rate

    def wanted(self) -> int:
        """Guesses to ask for this step; 0 while resting or when none would pay."""
        if self._resting > 0:
            self._resting -= 1
            if self._resting == 0:  # try again with fresh hopes
                self._kept = KeptRate(KEPT_MEMORY)
            return 0
        if self._costs.wants_plain():
            return 0  # one plain step, so that guessing steps have a price
        best, _ = self.best()
        if best == 0:
            self._resting = self._rest
            self._rest = min(MAX_REST, self._rest * 2)
        return best

    def best(self, rate: float | None = None) -> tuple[int, float]:
        """The guess count with the most tokens per unit of cost at a kept rate (by default
        this request's), and that value (tokens per plain step's time; (0, 1.0) when no
        count beats a plain step)."""
        rate = self.kept_rate if rate is None else rate
        best, best_value = 0, 1.0
        # Longer guesses are tried as shorter ones are measured (1, 2, 4, ...): an
        # unmeasured length is only an estimate, and a wrong one costs a whole step.
        reach = min(self.most, max(1, 2 * self._costs.largest_measured()))
        for guesses in range(1, reach + 1):
            value = expected_tokens(rate, guesses) / self._costs.relative(guesses)
            if value > best_value:
                best, best_value = guesses, value
        return best, best_value

    def catch_up_pays(self, catch_up_s: float, remaining_tokens: int, rate: float) -> bool:
        """Whether guessing over the request's remaining tokens, at the best value the
        kept rate allows, saves more time than catch_up_s (a Proposer first fed the whole
        context)."""
        plain_s = self._costs.plain_seconds()
        if plain_s is None:
            return True  # nothing measured yet: the first request finds out
        _, value = self.best(rate)
        return remaining_tokens * plain_s * (1.0 - 1.0 / value) > catch_up_s

    def record(self, proposed: int, kept: int) -> None:
        """One verification: `kept` of `proposed` guesses agreed with the model."""
        if proposed == 0:
            return
        self._kept.record(proposed, kept)
        if kept == proposed:
            self._rest = FIRST_REST
