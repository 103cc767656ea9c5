"""The shared tool-call parser: text, calls and mixtures, whole and split at every boundary."""

from __future__ import annotations

import itertools
import json

import pytest

from shoal.engine.outputs import RequestOutput, TokenLogprob
from shoal.protocol import ToolCall
from shoal.runner.tool_parser import ToolCallParser
from shoal.runner.tool_stream import IndexedCall, TextPiece, ToolCallStream

TOOLS = ("get_weather", "add")


def parse(text: str, splits: tuple[int, ...] = ()) -> list:
    """Events for text fed in pieces cut at `splits`, merged so splits compare equal."""
    counter = itertools.count()
    parser = ToolCallParser(TOOLS, new_id=lambda: f"call_{next(counter)}")
    bounds = [0, *splits, len(text)]
    events = []
    for start, end in itertools.pairwise(bounds):
        events += parser.feed(text[start:end])
    events += parser.finish()
    merged: list = []
    for event in events:
        if isinstance(event, str) and merged and isinstance(merged[-1], str):
            merged[-1] += event
        else:
            merged.append(event)
    return merged


def call(name: str, arguments: dict, index: int = 0) -> ToolCall:
    return ToolCall(id=f"call_{index}", name=name, arguments=json.dumps(arguments))


WEATHER = {"city": "Paris", "unit": "celsius"}
CASES = [
    ("plain text", "The sky is blue.", ["The sky is blue."]),
    ("text with a lone angle bracket", "a < b and c > d", ["a < b and c > d"]),
    ("tagged call",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
     "\n</tool_call>",
     [call("get_weather", WEATHER)]),
    ("text, call, text",
     'Let me look. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> Done.',
     ["Let me look. ", call("add", {"a": 1, "b": 2}), " Done."]),
    ("two tagged calls",
     '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
     [call("add", {"a": 1}), "\n", call("get_weather", {}, 1)]),
    ("bare JSON call with parameters",
     '  {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     [call("get_weather", WEATHER)]),
    ("bare JSON answer is text", '{"answer": 42}', ['{"answer": 42}']),
    ("bare JSON naming an unknown tool is text", '{"name": "nope", "arguments": {}}',
     ['{"name": "nope", "arguments": {}}']),
    ("marker with a list of calls",
     '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
     '{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     [call("add", {"a": 1}), call("get_weather", {"city": "Paris"}, 1)]),
    ("tagged call whose closing tag never came",
     '<tool_call>\n{"name": "add", "arguments": {"a": 1}}', [call("add", {"a": 1})]),
    ("arguments written as JSON text",
     '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>',
     [ToolCall(id="call_0", name="add", arguments='{"a": 1}')]),
    ("marker followed by prose is text", "<tool_call> is how I call tools",
     ["<tool_call> is how I call tools"]),
    ("unfinished call JSON is released as text", '<tool_call>{"name": "add", "argu',
     ['<tool_call>{"name": "add", "argu']),
    ("text ending in a partial marker", "see <tool", ["see <tool"]),
    ("tagged call naming an unknown tool is text",
     '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
     ['<tool_call>{"name": "nope", "arguments": {}}</tool_call>']),
]


@pytest.mark.parametrize("text, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_whole_text(text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize("text, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_split_at_every_boundary(text, expected):
    for cut in range(1, len(text)):
        assert parse(text, (cut,)) == expected, f"split at {cut}: {text[:cut]!r}"
    assert parse(text, tuple(range(1, len(text)))) == expected  # one character at a time


def test_call_text_is_never_released_before_the_call_completes():
    text = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    parser = ToolCallParser(TOOLS)
    released = ""
    for char in text:
        for event in parser.feed(char):
            if isinstance(event, str):
                released += event
    assert released == "Sure. "
    assert "{" not in released and "<" not in released


def test_calls_get_fresh_ids():
    parser = ToolCallParser(TOOLS)
    events = parser.feed('[TOOL_CALLS][{"name": "add", "arguments": {}}, '
                         '{"name": "add", "arguments": {}}]', final=True)
    ids = [event.id for event in events]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert parser.num_calls == 2


def _output(text: str, token_id: int, finished: bool = False, reason=None) -> RequestOutput:
    logprob = TokenLogprob(token_id=token_id, token=text, logprob=-0.5)
    return RequestOutput(request_id="r", text=text, token_ids=(token_id,), finished=finished,
                         finish_reason=reason, logprobs=(logprob,))


def test_stream_carries_held_tokens_with_released_text_and_indexes_calls():
    stream = ToolCallStream(TOOLS)
    assert stream.feed(_output("Hi <tool", 1)) == [
        TextPiece("Hi ", (1,), (TokenLogprob(token_id=1, token="Hi <tool", logprob=-0.5),))]
    assert stream.feed(_output('_call>{"name": "add", "arguments": {}}', 2)) == []
    pieces = stream.feed(_output("</tool_call>", 3))
    assert [type(p) for p in pieces] == [IndexedCall] and pieces[0].index == 0
    pieces = stream.feed(_output('<tool_call>{"name": "add", "arguments": {"a": 2}}', 4,
                                 finished=True, reason="stop"))
    assert pieces[0].index == 1 and pieces[0].call.arguments == '{"a": 2}'
    assert stream.finish_reason("stop") == "tool_calls"
    assert stream.finish_reason("length") == "length"


def test_stream_without_calls_keeps_the_finish_reason():
    stream = ToolCallStream(TOOLS)
    pieces = stream.feed(_output("just text", 7, finished=True, reason="stop"))
    assert pieces == [TextPiece("just text", (7,), pieces[0].logprobs)]
    assert stream.finish_reason("stop") == "stop"
