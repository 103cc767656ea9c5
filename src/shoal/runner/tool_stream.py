"""One request's engine outputs with its tool calls taken out of the text.

The pieces a request's output is split into (TextPiece, ReasoningPiece, IndexedCall) are
shared with harmony_stream.py, which splits a harmony reply the same way.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from shoal.engine.outputs import RequestOutput, TokenLogprob
from shoal.protocol import ToolCall
from shoal.runner.tool_parser import ToolCallParser


@dataclass(frozen=True)
class TextPiece:
    """Released text, with the tokens (and their logprobs) that arrived since the last piece."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class ReasoningPiece:
    """Reasoning text, with the tokens that arrived since the last piece."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class IndexedCall:
    index: int  # counts from 0 within the request
    call: ToolCall


class ToolCallStream:
    """Feeds a request's outputs through a ToolCallParser.

    Tokens held back with the text ride along with the next released piece; the tokens
    of a call are represented by the call itself.
    """

    reasoning_tokens = 0  # this format has no reasoning

    def __init__(self, tool_names: Collection[str]) -> None:
        self.parser = ToolCallParser(tool_names)
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []

    def feed(self, output: RequestOutput) -> list[TextPiece | IndexedCall]:
        self._token_ids.extend(output.token_ids)
        self._logprobs.extend(output.logprobs)
        events = self.parser.feed(output.text, final=output.finished)
        first_index = self.parser.num_calls - sum(isinstance(e, ToolCall) for e in events)
        pieces: list[TextPiece | IndexedCall] = []
        for event in events:
            if isinstance(event, ToolCall):
                pieces.append(IndexedCall(first_index, event))
                first_index += 1
            else:
                pieces.append(TextPiece(event, tuple(self._token_ids), tuple(self._logprobs)))
            self._token_ids, self._logprobs = [], []
        return pieces

    def finish_reason(self, reason: str) -> str:
        """"tool_calls" when the model ended normally after calling tools."""
        return "tool_calls" if self.parser.num_calls and reason == "stop" else reason
