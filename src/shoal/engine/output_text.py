"""A request's text side, kept by the engine beside the scheduler's Request: its output
tokens turned into text deltas (incremental detokenizing, stop strings), the grammar its
output must follow, and the logprobs waiting for the next RequestOutput."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from shoal.engine.grammar import Constraint
from shoal.engine.outputs import TokenLogprob
from shoal.engine.tokenizer.detokenizer import IncrementalDetokenizer, StopChecker


@dataclass
class OutputText:
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    constraint: Constraint | None = None  # the grammar the output must follow, if any
    reported_tokens: int = 0  # output tokens already turned into text
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)

    def text_of(self, new_ids: Sequence[int], eos_token_ids: Collection[int],
                ignore_eos: bool) -> tuple[str, bool]:
        """The text the new tokens add, and whether a stop string ended it (the text then
        ends before the stop string; later tokens are not read)."""
        text = ""
        for token_id in new_ids:
            if token_id in eos_token_ids and not ignore_eos:
                continue  # the end token itself is never shown
            piece, stopped = self.stop_checker.feed(self.detokenizer.add(token_id))
            text += piece
            if stopped:
                return text, True
        return text, False

    def tail(self) -> str:
        """The text held back (an unfinished character, a possible stop string's start),
        at the end of a request that no stop string ended."""
        return self.stop_checker.feed(self.detokenizer.flush())[0] + self.stop_checker.flush()
