"""The engine's guesser: per request, where guesses come from (its n-gram index, or a
proposer: the model's draft model) and an adaptive guess length.

Before each step the engine asks for guesses for its decoding requests; the scheduler gives
them room in the step (scheduler._fit_drafts), the model computes logits at every guessed
position, verify.kept_tokens keeps the agreeing prefix, and record() adapts the length.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from shoal.engine.request import Request
from shoal.engine.sampling import InvalidParameter, SamplingParams
from shoal.engine.speculation.config import SpeculativeConfig
from shoal.engine.speculation.length import DraftLength, GuessCost, StepCosts
from shoal.engine.speculation.ngram import NgramIndex
from shoal.engine.speculation.proposer import Proposer

NGRAM = SpeculativeConfig("ngram")


@dataclass
class _Guessing:
    length: DraftLength
    index: NgramIndex | None  # None: the proposer guesses
    synced_outputs: int = 0  # output tokens already in the index
    prompt: list[int] = field(default_factory=list)  # the proposer's context starts here
    # The proposer guessed last step too: its time now is guessing only, not catching up.
    warm: bool = False


class Speculator:
    """config: the model's own speculation (--speculative), or None: only requests that
    ask for it (x_speculative) speculate. proposer: the draft model, for config "draft"."""

    def __init__(self, config: SpeculativeConfig | None, model_id: str,
                 proposer: Proposer | None = None) -> None:
        self.config = config
        self.model_id = model_id
        self.proposer = proposer
        self._guessing: dict[str, _Guessing] = {}
        self.costs = StepCosts()
        self.guess_cost = GuessCost(self.costs)

    def add(self, request_id: str, prompt_token_ids: list[int],
            params: SamplingParams, constrained: bool) -> None:
        """Start guessing for a request if it and the model want it; InvalidParameter when
        it asks for a draft model this model does not have."""
        config = self._config_for(params)
        if config is None or constrained:
            # A grammar's mask would have to be advanced along the guesses; such requests
            # decode one token at a time.
            return
        if config.method == "draft":
            self._guessing[request_id] = _Guessing(
                DraftLength(config.num_drafts, self.costs, self.guess_cost), None,
                prompt=list(prompt_token_ids))
            return
        index = NgramIndex()
        index.extend(prompt_token_ids)
        self._guessing[request_id] = _Guessing(DraftLength(config.num_drafts, self.costs),
                                               index)

    def forget(self, request_id: str) -> None:
        guessing = self._guessing.pop(request_id, None)
        if guessing is not None and guessing.index is None:
            self.proposer.forget(request_id)

    def propose(self, decoding: Sequence[Request], max_rows: int) -> None:
        """Set draft_token_ids on the decoding requests that guess this step, keeping the
        step's decode rows (one per generated token and guess) within max_rows, so that
        they all run on the fused decode kernel and keep plain decoding's bits."""
        spare = max_rows - len(decoding)
        for request in decoding:
            guessing = self._guessing.get(request.request_id)
            if guessing is None:
                continue
            outputs = request.output_token_ids
            if guessing.index is not None:
                guessing.index.extend(outputs[guessing.synced_outputs:])
                guessing.synced_outputs = len(outputs)
            count = guessing.length.wanted()
            max_tokens = request.params.max_tokens
            if max_tokens is not None:
                # The step adds the kept guesses plus one token of the model's own.
                count = min(count, max_tokens - len(outputs) - 1)
            count = min(count, spare)
            if count <= 0:
                guessing.warm = False
                continue
            if guessing.index is not None:
                request.draft_token_ids = guessing.index.propose(count)
            else:
                request.draft_token_ids = self._ask_proposer(guessing, request, count)
            spare -= len(request.draft_token_ids)

    def _ask_proposer(self, guessing: _Guessing, request: Request, count: int) -> list[int]:
        started = time.perf_counter()
        proposal = self.proposer.propose(request.request_id,
                                         guessing.prompt + request.output_token_ids, count)
        seconds = time.perf_counter() - started
        tokens = list(proposal.tokens[:count]) if proposal is not None else []
        if guessing.warm and tokens:
            self.guess_cost.observe(len(tokens), seconds)
        guessing.warm = bool(tokens)
        return tokens

    def record(self, request_id: str, proposed: int, kept: int) -> None:
        guessing = self._guessing.get(request_id)
        if guessing is not None:
            guessing.length.record(proposed, kept)

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
