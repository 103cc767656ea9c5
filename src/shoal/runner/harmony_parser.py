"""Reads a harmony reply (gpt-oss) as it streams: reasoning, answer and tool calls apart.

The reply continues a prompt that ends with `<|start|>assistant`, so it opens with the
first message's header. Each message is a header, `<|message|>`, then content closed by
`<|end|>` (more messages follow, each after `<|start|>`) or by the end of the stream (the
engine stops at `<|return|>` and `<|call|>` and never shows them):

    <|channel|>analysis<|message|>...<|end|>                           reasoning
    <|start|>assistant<|channel|>final<|message|>...                    the answer
    <|start|>assistant<|channel|>commentary<|message|>...<|end|>        a preamble: answer
    <|start|>assistant<|channel|>commentary to=functions.X <|constrain|>json<|message|>{...}
                                                                        a call to X

Special tokens arrive as text (the engine keeps them for harmony requests); a suffix that
may be the start of one is held back, so no header ever reaches the client.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass

from shoal.protocol import ToolCall
from shoal.runner.tool_parser import earliest_marker, new_call_id, partial_marker_length

START, MESSAGE, END = "<|start|>", "<|message|>", "<|end|>"
# Tokens that close a message's content (<|call|> and <|return|> only if the engine shows them).
CONTENT_ENDS = (END, START, "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_SPECIAL = re.compile(r"<\|[a-z_]+\|>")


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Answer:
    text: str


HarmonyEvent = Reasoning | Answer | ToolCall


class HarmonyParser:
    """Feed text deltas in, get Reasoning, Answer and ToolCall events out, in order."""

    def __init__(self, tool_names: Collection[str],
                 new_id: Callable[[], str] = new_call_id) -> None:
        self._names = frozenset(tool_names)
        self._new_id = new_id
        self._buffer = ""
        self._in_header = True  # the reply opens with its first header (in _buffer)
        self._channel: str | None = None
        self._recipient: str | None = None
        self._arguments = ""  # a call's content, until its message ends
        self.num_calls = 0
        self.messages = 0  # messages whose content has begun

    @property
    def reasoning(self) -> bool:
        """Inside a reasoning message's content now."""
        return not self._in_header and self._kind() is Reasoning

    @property
    def answering(self) -> bool:
        """Inside an answer's content now (not a header, reasoning or a call)."""
        return not self._in_header and self._kind() is Answer

    def feed(self, text: str, final: bool = False) -> list[HarmonyEvent]:
        self._buffer += text
        events: list[HarmonyEvent] = []
        while self._step(events, final):
            pass
        if final:
            self._finish(events)
        return events

    def _step(self, events: list[HarmonyEvent], final: bool) -> bool:
        """Consume what can be consumed; False when more text is needed."""
        if self._in_header:
            at = self._buffer.find(MESSAGE)
            if at == -1:
                return False
            self._begin_content(self._buffer[:at])
            self._buffer = self._buffer[at + len(MESSAGE):]
            return True
        at, token = earliest_marker(self._buffer, CONTENT_ENDS)
        if token is None:
            keep = 0 if final else partial_marker_length(self._buffer, CONTENT_ENDS)
            self._content(events, self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        self._content(events, self._buffer[:at])
        self._end_message(events)
        # After <|end|> the next message's <|start|> and role come before its header.
        self._buffer = self._buffer[at + len(token):]
        self._in_header = True
        return True

    def _begin_content(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._channel = channel.group(1) if channel else None
        self._recipient = recipient.group(1) if recipient else None
        self._in_header, self._arguments = False, ""
        self.messages += 1

    def _kind(self) -> type[Reasoning] | type[Answer] | None:
        """What this message's content is: None for a call's arguments."""
        if self._recipient is not None and self._recipient != "assistant":
            return None
        return Reasoning if self._channel == "analysis" else Answer

    def _content(self, events: list[HarmonyEvent], text: str) -> None:
        if not text:
            return
        kind = self._kind()
        if kind is None:
            self._arguments += text
        elif events and type(events[-1]) is kind:
            events[-1] = kind(events[-1].text + text)  # type: ignore[union-attr]
        else:
            events.append(kind(text))

    def _end_message(self, events: list[HarmonyEvent]) -> None:
        if self._kind() is None:
            events.append(self._call())
            self._recipient = None

    def _call(self) -> HarmonyEvent:
        """The call just closed; one the request cannot take (a tool it did not offer,
        arguments that are not an object) is kept as reasoning, never dropped."""
        recipient, arguments = self._recipient or "", self._arguments.strip()
        name = recipient.removeprefix("functions.")
        try:
            valid = isinstance(json.loads(arguments or "{}"), dict)
        except ValueError:
            valid = False
        if not (recipient.startswith("functions.") and name in self._names and valid):
            return Reasoning(f"to={recipient}: {arguments}")
        self.num_calls += 1
        return ToolCall(id=self._new_id(), name=name, arguments=arguments or "{}")

    def _finish(self, events: list[HarmonyEvent]) -> None:
        """The stream ended (at <|return|> or <|call|>, or cut short)."""
        if self._in_header:
            leftover = self._buffer
            if self.messages == 0 and leftover and not _SPECIAL.search(leftover):
                events.append(Answer(leftover))  # the model ignored the format entirely
        elif self._kind() is None:
            events.append(self._call())
        self._buffer = ""

    def prefill(self, header: str) -> None:
        """The reply's first header was written into the prompt (a forced call or answer);
        what the model writes next is that message's content."""
        self._begin_content(header)
