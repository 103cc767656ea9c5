"""Finds tool calls in a model's streamed text, in any format shoal knows.

A call is a JSON object {"name": ..., "arguments" or "parameters": {...}} (or a list of
them) that either follows a marker (`<tool_call>` ... `</tool_call>`, `[TOOL_CALLS]`,
`<|python_tag|>`) or is the whole output on its own. Text that may still turn out to be part
of a call is held back, so raw call JSON never reaches the client as text; anything that does
not parse as a call to an offered tool is released as ordinary text at the end.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Collection
from typing import Any

from shoal.protocol import ToolCall

# marker -> the text that closes it (None: the call ends where its JSON value ends)
MARKERS: dict[str, str | None] = {
    "<tool_call>": "</tool_call>",
    "[TOOL_CALLS]": None,
    "<|python_tag|>": None,
}

Event = str | ToolCall


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """Feed text deltas in, get text pieces and complete ToolCalls out, in order."""

    def __init__(self, tool_names: Collection[str],
                 new_id: Callable[[], str] = new_call_id) -> None:
        self._names = frozenset(tool_names)
        self._new_id = new_id
        self._buffer = ""  # text received but not yet released
        self._at_start = True  # only whitespace and bare-JSON calls so far
        self._marker: str | None = None  # inside a call opened by this marker
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> list[Event]:
        """Events for this delta; final: the output ends here, so release all that is held."""
        self._buffer += text
        return self._drain(final)

    def finish(self) -> list[Event]:
        return self.feed("", final=True)

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self._step(events, final):
            pass
        merged: list[Event] = []
        for event in events:
            if isinstance(event, str) and merged and isinstance(merged[-1], str):
                merged[-1] += event
            elif event != "":
                merged.append(event)
        return merged

    # ---- one step: returns whether it made progress -----------------------------------------

    def _step(self, events: list[Event], final: bool) -> bool:
        if self._marker is not None:
            return self._in_call(events, final)
        if self._at_start:
            return self._at_output_start(events, final)
        return self._in_text(events, final)

    def _at_output_start(self, events: list[Event], final: bool) -> bool:
        stripped = self._buffer.lstrip()
        if not stripped:
            if final:
                self._release(events, len(self._buffer))
            return False
        if stripped[0] not in "{[":
            self._at_start = False
            return True
        decoded = _decode_json(stripped)
        if decoded is None and not final:
            return False  # a bare JSON call may still be forming
        if decoded is not None:
            value, end = decoded
            calls = self._calls(value)
            if calls is not None:  # more bare calls may follow, one per line
                events.extend(calls)
                self._buffer = stripped[end:]
                return True
        self._at_start = False
        return True  # not a call: it is text (released by _in_text)

    def _in_text(self, events: list[Event], final: bool) -> bool:
        at, marker = earliest_marker(self._buffer, MARKERS)
        if marker is not None:
            self._release(events, at)
            self._marker = marker
            return True
        keep = 0 if final else partial_marker_length(self._buffer, MARKERS)
        self._release(events, len(self._buffer) - keep)
        return False

    def _in_call(self, events: list[Event], final: bool) -> bool:
        marker = self._marker
        closing = MARKERS[marker]
        body = self._buffer[len(marker):]
        if closing is not None and closing in body:
            inner, rest = body.split(closing, 1)
            decoded = _decode_json(inner.strip())
            calls = self._calls(decoded[0]) if decoded and not inner.strip()[decoded[1]:] else None
            self._end_call(events, calls, len(self._buffer) - len(rest))
            return True
        stripped = body.lstrip()
        if stripped and stripped[0] not in "{[":
            self._release(events, len(marker))  # a marker not followed by JSON is just text
            self._marker = None
            return True
        decoded = _decode_json(stripped) if stripped else None
        if decoded is not None and (closing is None or final):
            # A marker without a closing text ends with its JSON; a tagged call whose closing
            # tag never came (the model stopped right after the JSON) counts as well.
            value, end = decoded
            self._end_call(events, self._calls(value), len(self._buffer) - len(stripped) + end)
            return True
        if final:
            self._end_call(events, None, len(self._buffer))
        return False

    def _end_call(self, events: list[Event], calls: list[ToolCall] | None, consumed: int) -> None:
        if calls is None:
            self._release(events, consumed)  # not a valid call: the raw text is the answer
        else:
            events.extend(calls)
            self._buffer = self._buffer[consumed:]
        self._marker = None

    def _release(self, events: list[Event], length: int) -> None:
        events.append(self._buffer[:length])
        self._buffer = self._buffer[length:]

    def _calls(self, value: Any) -> list[ToolCall] | None:
        """ToolCalls for a call object or a list of them; None unless every one names an
        offered tool with object arguments."""
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            if isinstance(item, dict) and isinstance(item.get("function"), dict):
                item = item["function"]  # {"type": "function", "function": {...}}
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) \
                    or item["name"] not in self._names:
                return None
            arguments = _arguments_text(item.get("arguments", item.get("parameters", {})))
            if arguments is None:
                return None
            calls.append(ToolCall(id=self._new_id(), name=item["name"], arguments=arguments))
        if not calls:
            return None
        self.num_calls += len(calls)
        return calls


def _decode_json(text: str) -> tuple[Any, int] | None:
    """The JSON value text starts with and where it ends, or None while incomplete/invalid."""
    try:
        return json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None


def _arguments_text(arguments: Any) -> str | None:
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        decoded = _decode_json(arguments.strip())
        if decoded is not None and isinstance(decoded[0], dict):
            return arguments.strip()
    return None


def earliest_marker(text: str, markers: Collection[str]) -> tuple[int, str | None]:
    """Where the first of markers starts in text, and which (len(text), None if none)."""
    best_at, best = len(text), None
    for marker in markers:
        at = text.find(marker)
        if at != -1 and at < best_at:
            best_at, best = at, marker
    return best_at, best


def partial_marker_length(text: str, markers: Collection[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of markers: text
    a stream must hold back until the next piece says whether a marker begins there."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[len(text) - length:]):
                longest = length
                break
    return longest
