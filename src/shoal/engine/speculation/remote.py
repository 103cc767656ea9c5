"""A Proposer on another node, asked synchronously within the engine's step.

Per request it remembers the tokens the far side holds and sends only the rest (with the
point to cut back to, when earlier tokens changed). Each call waits at most a deadline a
little above the measured round trip (an average that forgets; within a floor and a
ceiling). The ceiling is what k guesses could save at most: k of the verifier's plain decode
steps (measured; CEILING_S until then, and never below it, up to MAX_CEILING_S), so a slow
verifier on a loaded host still waits for round trips that pay, and a fast one never waits
longer than its guesses are worth. A late, missing, malformed or out-of-vocabulary answer returns None, and the
proposer then rests (twice as long after each failure in a row, up to MAX_REST_S), so a
dead proposer costs the verifier one deadline now and then, never an error or a wrong
token: the verifier decodes alone and checks every guess it does get.

An empty answer (nothing to guess from yet) is cheap to give but costs a round trip to
get, so a request that got one asks again only after 1, 2, 4, ... (up to MAX_QUIET)
more tokens of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from shoal.engine.speculation.proposer import Proposal

log = logging.getLogger("shoal.engine.speculation")

FLOOR_S = 0.005
CEILING_S = 0.06       # the ceiling before the verifier's step is measured, and its least
MAX_CEILING_S = 1.0
LATENCY_MEMORY = 0.8   # weight of the previous average in each new one
DEADLINE_FACTOR = 1.5  # deadline = factor * average round trip + slack
DEADLINE_SLACK_S = 0.002
FIRST_REST_S = 0.05
MAX_REST_S = 5.0
MAX_QUIET = 8  # tokens a request decodes alone after empty answers, at most


@dataclass(frozen=True)
class LinkAnswer:
    outcome: str  # "ok", "resync" (the far side lacks the context) or "none"
    tokens: Sequence[int] = ()
    probs: Sequence[float] = ()


class ProposalLink(Protocol):
    """The way to the proposer node (runner/proposals.py: through the node process)."""

    def ask(self, request_id: str, cut: int, tokens: list[int], k: int,
            timeout_s: float) -> LinkAnswer | None:
        """None: no answer within timeout_s."""

    def forget(self, request_id: str) -> None: ...


class LatencyEstimate:
    def __init__(self) -> None:
        self.average_s: float | None = None

    def deadline_s(self, ceiling_s: float = CEILING_S) -> float:
        if self.average_s is None:
            return ceiling_s  # nothing measured yet: the first call may set up a session
        wanted = DEADLINE_FACTOR * self.average_s + DEADLINE_SLACK_S
        return min(ceiling_s, max(FLOOR_S, wanted))

    def observe(self, seconds: float) -> None:
        self.average_s = seconds if self.average_s is None else \
            LATENCY_MEMORY * self.average_s + (1 - LATENCY_MEMORY) * seconds

    def missed(self, deadline_s: float) -> None:
        """A call took longer than deadline_s: allow more next time (up to the ceiling)."""
        self.observe(max(deadline_s * 2, self.average_s or 0.0))


class RemoteProposer:
    """step_s: the verifier's plain decode step in seconds (None until measured)."""

    def __init__(self, link: ProposalLink, vocab_size: int,
                 clock: Callable[[], float] = time.monotonic,
                 step_s: Callable[[], float | None] = lambda: None) -> None:
        self._link = link
        self._step_s = step_s
        self._vocab_size = vocab_size
        self._clock = clock
        self._held: dict[str, list[int]] = {}  # request -> tokens the far side holds
        # request -> (empty answers in a row, context length to reach before asking again)
        self._quiet: dict[str, tuple[int, int]] = {}
        self.latency = LatencyEstimate()
        self._failures = 0
        self._resting_until = 0.0
        self.calls = self.answered = self.failed = 0

    def propose(self, request_id: str, context: Sequence[int], k: int) -> Proposal | None:
        if k <= 0 or self._clock() < self._resting_until:
            return None
        if len(context) < self._quiet.get(request_id, (0, 0))[1]:
            return None
        try:
            return self._propose(request_id, context, k)
        except Exception:  # noqa: BLE001 - never raise into the engine's step
            log.exception("asking the proposer node failed")
            self._failed()
            return None

    def forget(self, request_id: str) -> None:
        self._quiet.pop(request_id, None)
        if self._held.pop(request_id, None) is not None:
            try:
                self._link.forget(request_id)
            except Exception:  # noqa: BLE001 - its session then expires on its own
                log.warning("could not tell the proposer node to forget %s", request_id)

    def _propose(self, request_id: str, context: Sequence[int], k: int) -> Proposal | None:
        held = self._held.setdefault(request_id, [])
        cut = _common_prefix(held, context)
        fresh = list(context[cut:])
        deadline_s = self.latency.deadline_s(self.ceiling_s(k))
        self.calls += 1
        started = self._clock()
        answer = self._link.ask(request_id, cut, fresh, k, deadline_s)
        if answer is None:
            self.latency.missed(deadline_s)
            self._failed()
            return None
        if answer.outcome == "resync":
            held.clear()  # the whole context goes next time
            return None
        if answer.outcome != "ok":
            self._failed()
            return None
        # Cutting then appending is idempotent on the far side: after a lost answer the
        # next call resends from the same cut, so `held` changes only on an answer.
        del held[cut:]
        held.extend(fresh)
        self.latency.observe(self._clock() - started)
        tokens, probs = list(answer.tokens), list(answer.probs)
        if len(tokens) > k or len(probs) != len(tokens) or not all(
                isinstance(t, int) and 0 <= t < self._vocab_size for t in tokens):
            log.warning("proposer node answered a malformed proposal; ignored")
            self._failed()
            return None
        self._failures = 0
        self.answered += 1
        if tokens:
            self._quiet.pop(request_id, None)
        else:
            empties = self._quiet.get(request_id, (0, 0))[0] + 1
            self._quiet[request_id] = (empties, len(context)
                                       + min(MAX_QUIET, 2 ** (empties - 1)))
        return Proposal(tokens=tokens, probs=probs)

    def ceiling_s(self, k: int) -> float:
        """The longest wait k guesses could pay for: k plain steps of the verifier."""
        step_s = self._step_s()
        if step_s is None:
            return CEILING_S
        return min(MAX_CEILING_S, max(CEILING_S, k * step_s))

    def _failed(self) -> None:
        self.failed += 1
        self._failures += 1
        rest_s = min(MAX_REST_S, FIRST_REST_S * 2 ** (self._failures - 1))
        self._resting_until = self._clock() + rest_s


def _common_prefix(held: list[int], context: Sequence[int]) -> int:
    """How many leading tokens of context the far side already holds."""
    if len(held) <= len(context) and list(context[:len(held)]) == held:
        return len(held)  # the usual case: the context only grew
    count = 0
    for mine, theirs in zip(held, context):
        if mine != theirs:
            break
        count += 1
    return count
