"""Reasoning written between <think> and </think> (Qwen3, QwQ, DeepSeek-R1 templates), read
as it streams and kept apart from the answer; the answer then goes through the tool-call
parser as any other reply does.

A chat template that mentions </think> marks such a model. Its reply opens with the
reasoning block (or, when the prompt already ends with <think>, inside it); text after
</think> is the answer. A tag split across deltas is held back until it is whole.
"""

from __future__ import annotations

from collections.abc import Collection

from shoal.engine.outputs import RequestOutput, TokenLogprob
from shoal.runner.tool_stream import IndexedCall, ReasoningPiece, TextPiece, ToolCallStream

OPEN, CLOSE = "<think>", "</think>"


def uses_think_tags(template_source: str) -> bool:
    return CLOSE in template_source


def opens_thinking(prompt: str) -> bool:
    """The prompt already opened the reasoning block: the reply starts inside it."""
    return prompt.rstrip().endswith(OPEN)


class ThinkSplitter:
    """Feed text deltas in, get (reasoning, answer) text out. The newlines templates put
    around the tags are not part of either, however the deltas split them."""

    def __init__(self, inside: bool = False) -> None:
        self._state = "inside" if inside else "before"  # before, inside, answer
        self._buffer = ""
        self._at_start = True  # no text of the current part released yet

    @property
    def reasoning(self) -> bool:
        return self._state == "inside"


    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._buffer += text
        reasoning = ""
        if self._state == "before":
            stripped = self._buffer.lstrip()
            if stripped.startswith(OPEN):
                self._enter("inside", stripped[len(OPEN):])
            elif not final and OPEN.startswith(stripped):
                return "", ""  # may still become <think>
            else:
                self._state = "answer"  # the model did not reason this time
        if self._state == "inside":
            at = self._buffer.find(CLOSE)
            if at == -1:
                keep = 0 if final else _held_length(self._buffer)
                reasoning = self._release(len(self._buffer) - keep)
                return reasoning, ""
            reasoning = self._release(len(self._buffer[:at].rstrip("\n")))
            self._enter("answer", self._buffer[self._buffer.find(CLOSE) + len(CLOSE):])
        return reasoning, self._release(len(self._buffer))

    def _enter(self, state: str, rest: str) -> None:
        self._state, self._buffer, self._at_start = state, rest, True

    def _release(self, length: int) -> str:
        """The buffer's first length characters, less the newlines that open a part."""
        text, self._buffer = self._buffer[:length], self._buffer[length:]
        if self._at_start:
            text = text.lstrip("\n")
            self._at_start = not text
        return text


class ThinkStream:
    """A request's outputs split into reasoning and answer; tool calls are taken out of the
    answer (when tools are offered) as ToolCallStream does. Tokens ride along with the next
    piece released after them (logprobs only of the answer's); return_reasoning False:
    reasoning is counted but never released."""

    def __init__(self, tool_names: Collection[str], return_reasoning: bool = True,
                 inside: bool = False) -> None:
        self.splitter = ThinkSplitter(inside)
        self.tools = ToolCallStream(tool_names) if tool_names else None
        self.return_reasoning = return_reasoning
        self.reasoning_tokens = 0
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []

    def feed(self, output: RequestOutput) -> list[TextPiece | ReasoningPiece | IndexedCall]:
        was_reasoning = self.splitter.reasoning
        self._token_ids.extend(output.token_ids)
        if not was_reasoning:
            self._logprobs.extend(output.logprobs)
        reasoning, answer = self.splitter.feed(output.text, final=output.finished)
        if self.splitter.reasoning or (reasoning and not answer):
            self._logprobs = []  # logprobs are the answer's, never the reasoning's
        if was_reasoning or reasoning:
            self.reasoning_tokens += len(output.token_ids)
        pieces: list[TextPiece | ReasoningPiece | IndexedCall] = []
        if reasoning and self.return_reasoning:
            pieces.append(ReasoningPiece(reasoning, self._take()[0]))
        if self.tools is not None and (answer or output.finished):
            token_ids, logprobs = self._take()
            pieces += self.tools.feed(RequestOutput(
                request_id=output.request_id, text=answer, token_ids=token_ids,
                finished=output.finished, logprobs=logprobs))
        elif self.tools is None and answer:
            pieces.append(TextPiece(answer, *self._take()))
        return pieces

    def _take(self) -> tuple[tuple[int, ...], tuple[TokenLogprob, ...]]:
        taken = tuple(self._token_ids), tuple(self._logprobs)
        self._token_ids, self._logprobs = [], []
        return taken

    def finish_reason(self, reason: str) -> str:
        return self.tools.finish_reason(reason) if self.tools is not None else reason


def _held_length(text: str) -> int:
    """How much of text's end to hold back: a proper prefix of </think>, and the newlines
    before it (they may turn out to precede the tag)."""
    partial = 0
    for length in range(min(len(CLOSE) - 1, len(text)), 0, -1):
        if CLOSE.startswith(text[len(text) - length:]):
            partial = length
            break
    body = text[:len(text) - partial]
    return partial + len(body) - len(body.rstrip("\n"))
