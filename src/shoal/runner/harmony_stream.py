"""One request's engine outputs, read as a harmony reply: answer text, reasoning and tool
calls apart (harmony_parser.py), in the pieces the runner turns into chunks."""

from __future__ import annotations

from collections.abc import Collection

from shoal.engine.outputs import RequestOutput, TokenLogprob
from shoal.protocol import ToolCall
from shoal.runner.harmony_parser import Answer, HarmonyParser, Reasoning
from shoal.runner.tool_stream import IndexedCall, ReasoningPiece, TextPiece


class HarmonyStream:
    """Feeds a request's outputs through a HarmonyParser.

    Tokens ride along with the next piece released after them, whatever its kind; logprobs
    only of tokens inside an answer. A token that writes reasoning, or arrives while the reply is
    inside a reasoning message (the <|end|> closing it), counts as a reasoning token.
    return_reasoning False: reasoning is counted but never released (the client did not
    ask for it; a harmony model reasons anyway).
    """

    def __init__(self, tool_names: Collection[str], return_reasoning: bool = True,
                 prefilled_header: str | None = None) -> None:
        self.parser = HarmonyParser(tool_names)
        if prefilled_header is not None:
            self.parser.prefill(prefilled_header)
        self.return_reasoning = return_reasoning
        self.reasoning_tokens = 0
        self._num_calls = 0
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []

    def feed(self, output: RequestOutput) -> list[TextPiece | ReasoningPiece | IndexedCall]:
        was_reasoning = self.parser.reasoning
        self._token_ids.extend(output.token_ids)
        if self.parser.answering:  # logprobs are the answer's, never a header's
            self._logprobs.extend(output.logprobs)
        events = self.parser.feed(output.text, final=output.finished)
        if was_reasoning or any(isinstance(event, Reasoning) for event in events):
            self.reasoning_tokens += len(output.token_ids)
        pieces: list[TextPiece | ReasoningPiece | IndexedCall] = []
        for event in events:
            if isinstance(event, ToolCall):
                pieces.append(IndexedCall(self._num_calls, event))
                self._num_calls += 1
            elif isinstance(event, Reasoning):
                if not self.return_reasoning:
                    continue  # its tokens ride with the next piece, still counted there
                pieces.append(ReasoningPiece(event.text, tuple(self._token_ids)))
            elif isinstance(event, Answer):
                pieces.append(TextPiece(event.text, tuple(self._token_ids),
                                        tuple(self._logprobs)))
            self._token_ids, self._logprobs = [], []
        return pieces

    def finish_reason(self, reason: str) -> str:
        """"tool_calls" when the model ended normally after calling tools."""
        return "tool_calls" if self.parser.num_calls and reason == "stop" else reason
