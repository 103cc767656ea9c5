"""The engine's guesser: per request, an n-gram index (or a Proposer: the model's draft
model for method "draft", a proposer node for method "remote") and an adaptive guess length.

Before each step the engine asks for guesses for its decoding requests; the scheduler gives
them room in the step (scheduler._fit_drafts), the model computes logits at every guessed
position, verify.kept_tokens keeps the agreeing prefix, and record() adapts the length.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.engine.request import Request
from shoal.engine.sampling import InvalidParameter, SamplingParams
from shoal.engine.speculation.config import SpeculativeConfig
from shoal.engine.speculation.length import (
    COST_MEMORY,
    ENGINE_KEPT_MEMORY,
    DraftLength,
    KeptRate,
    StepCosts,
)
from shoal.engine.speculation.ngram import NgramIndex
from shoal.engine.speculation.proposer import Proposer

NGRAM = SpeculativeConfig("ngram")
# Tokens a request without max_tokens is taken to have left, when pricing a Proposer's
# catch-up on its context.
EXPECTED_OUTPUT = 256


@dataclass
class _Guessing:
    index: NgramIndex | None  # None: the Proposer guesses from `context`
    length: DraftLength
    synced_outputs: int = 0  # output tokens already in the index (or context)
    context: list[int] | None = None  # prompt + outputs, for the Proposer
    # The Proposer guessed for this request last step: its answer now costs guessing only,
    # not catching up on the context (a first ask feeds a draft model the whole prompt).
    warm: bool = False
    fed: bool = False  # the Proposer was asked for this request (it holds its context)
    declined: bool = False  # feeding the Proposer its context did not pay (yet)


class Speculator:
    """config: the model's own speculation (--speculative), or None: only requests that
    ask for it (x_speculative) speculate. proposer: the draft model, for method "draft"."""

    def __init__(self, config: SpeculativeConfig | None, model_id: str,
                 proposer: Proposer | None = None) -> None:
        self.config = config
        self.model_id = model_id
        self._guessing: dict[str, _Guessing] = {}
        # Step costs by where guesses come from: n-grams are free to make, a Proposer's
        # wait counts in its steps' cost (one table would make each look like the other).
        self.costs = StepCosts()
        self.proposer_costs = StepCosts()
        # Guesses for methods "draft" and "remote" (for "remote" the runner sets it:
        # runner/proposals.py); without one such requests decode alone.
        self.proposer = proposer
        self._asked_s = 0.0  # this step's wait for the Proposer's guesses
        self._asked: bool | None = None
        # Seconds per context token of a Proposer's first ask for a request, and how often
        # its guesses were kept over recent requests: what a catch-up is priced with.
        self._feed_s: float | None = None
        self._proposer_kept = KeptRate(ENGINE_KEPT_MEMORY)

    def add(self, request_id: str, prompt_token_ids: list[int],
            params: SamplingParams, constrained: bool) -> None:
        """Start guessing for a request if it and the model want it; InvalidParameter when
        it asks for a draft model this model does not have."""
        config = self._config_for(params)
        if config is None or constrained:
            # A grammar's mask would have to be advanced along the guesses; such requests
            # decode one token at a time.
            return
        if config.method in ("draft", "remote"):
            length = DraftLength(config.num_drafts, self.proposer_costs)
            self._guessing[request_id] = _Guessing(None, length,
                                                   context=list(prompt_token_ids))
            return
        index = NgramIndex()
        index.extend(prompt_token_ids)
        self._guessing[request_id] = _Guessing(index, DraftLength(config.num_drafts,
                                                                  self.costs))

    def forget(self, request_id: str) -> None:
        guessing = self._guessing.pop(request_id, None)
        if guessing is not None and guessing.index is None and self.proposer is not None:
            self.proposer.forget(request_id)

    def propose(self, decoding: Sequence[Request], max_rows: int) -> None:
        """Set draft_token_ids on the decoding requests that guess this step, keeping the
        step's decode rows (one per generated token and guess) within max_rows, so that
        they all run on the fused decode kernel and keep plain decoding's bits."""
        spare = max_rows - len(decoding)
        self._asked_s = 0.0
        self._asked: bool | None = None  # a Proposer was asked: warm (True) or cold
        for request in decoding:
            guessing = self._guessing.get(request.request_id)
            if guessing is None:
                continue
            outputs = request.output_token_ids
            fresh = outputs[guessing.synced_outputs:]
            if guessing.index is not None:
                guessing.index.extend(fresh)
            else:
                guessing.context.extend(fresh)
            guessing.synced_outputs = len(outputs)
            count = guessing.length.wanted()
            max_tokens = request.params.max_tokens
            if max_tokens is not None:
                # The step adds the kept guesses plus one token of the model's own.
                count = min(count, max_tokens - len(outputs) - 1)
            count = min(count, spare)
            if count > 0 and guessing.index is None and not guessing.fed:
                count = count if self._catch_up_pays(request, guessing) else 0
            if count > 0:
                request.draft_token_ids = self._guess(request.request_id, guessing, count)
                spare -= len(request.draft_token_ids)
            else:
                guessing.warm = False

    def _guess(self, request_id: str, guessing: _Guessing, count: int) -> list[int]:
        if guessing.index is not None:
            return guessing.index.propose(count)
        if self.proposer is None:
            return []
        started = time.perf_counter()
        proposal = self.proposer.propose(request_id, guessing.context, count)
        seconds = time.perf_counter() - started
        self._asked_s += seconds
        self._asked = guessing.warm
        if not guessing.fed:
            guessing.fed = True
            per_token = seconds / max(1, len(guessing.context))
            self._feed_s = per_token if self._feed_s is None else \
                COST_MEMORY * self._feed_s + (1 - COST_MEMORY) * per_token
        tokens = [] if proposal is None else list(proposal.tokens[:count])
        guessing.warm = bool(tokens)
        return tokens

    def _catch_up_pays(self, request: Request, guessing: _Guessing) -> bool:
        """Before a Proposer's first ask for a request: whether feeding it the context
        (priced by earlier first asks) pays over the tokens the request may still make
        (its max_tokens, or EXPECTED_OUTPUT without one), at the rate the Proposer's
        guesses were kept over recent requests."""
        if self._feed_s is None:
            return True
        limit = request.params.max_tokens
        remaining = (limit if limit is not None else EXPECTED_OUTPUT) \
            - len(request.output_token_ids)
        if guessing.length.catch_up_pays(self._feed_s * len(guessing.context), remaining,
                                         self._proposer_kept.rate):
            return True
        if not guessing.declined:
            # An untried request brings no evidence: later ones hope again, slowly.
            guessing.declined = True
            self._proposer_kept.relax()
        return False

    def observe_step(self, guesses: int, seconds: float) -> None:
        """A step of one request took `seconds` to verify `guesses` guesses; getting them
        from a Proposer is part of what they cost (unless it was catching up)."""
        if guesses == 0:
            self.costs.observe(0, seconds)
            self.proposer_costs.observe(0, seconds)
        elif self._asked is None:
            self.costs.observe(guesses, seconds)
        elif self._asked:
            self.proposer_costs.observe(guesses, seconds + self._asked_s)

    def record(self, request_id: str, proposed: int, kept: int) -> None:
        guessing = self._guessing.get(request_id)
        if guessing is not None:
            guessing.length.record(proposed, kept)
            if guessing.index is None and proposed:
                self._proposer_kept.record(proposed, kept)

    def _config_for(self, params: SamplingParams) -> SpeculativeConfig | None:
        choice = params.speculative
        if choice is None:
            return self.config
        if choice == "off":
            return None
        if choice == "ngram":
            if self.config is not None and self.config.method == "ngram":
                return self.config
            return NGRAM
        if self.config is None or self.config.method != "draft" or self.proposer is None:
            raise InvalidParameter(
                "x_speculative", f"model {self.model_id!r} has no draft model; start it with "
                f"--speculative {self.model_id}=draft:DRAFT_MODEL, or ask for "
                f"x_speculative \"ngram\"")
        return self.config
