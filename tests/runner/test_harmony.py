"""Harmony (gpt-oss's chat format): shoal's renderer against the format's documented
prompts, and the streaming reader of a reply, whole and split at every boundary."""

from __future__ import annotations

import itertools
from datetime import date

import pytest

from shoal.engine.outputs import RequestOutput
from shoal.engine.sampling import InvalidParameter
from shoal.engine.tokenizer.chat_template import ChatTemplate
from shoal.protocol import (
    ChatMessage,
    ForcedTool,
    GenerationRequest,
    ReasoningRequest,
    ResponseFormat,
    ToolCall,
    ToolSpec,
)
from shoal.runner.harmony_parser import Answer, HarmonyParser, Reasoning
from shoal.runner.harmony_render import render_harmony, schema_type
from shoal.runner.harmony_stream import HarmonyStream
from shoal.runner.harmony_use import forced_reply, harmony_prompt
from shoal.runner.tool_stream import IndexedCall, ReasoningPiece, TextPiece

DAY = date(2025, 6, 28)
FORMAT = {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}
# The three functions of the format's documented example (openai/harmony docs/format.md).
DOC_TOOLS = (
    ToolSpec(name="get_location", description="Gets the location of the user."),
    ToolSpec(name="get_current_weather",
             description="Gets the current weather in the provided location.",
             parameters={"type": "object", "required": ["location"], "properties": {
                 "location": {"type": "string",
                              "description": "The city and state, e.g. San Francisco, CA"},
                 "format": FORMAT}}),
    ToolSpec(name="get_multiple_weathers",
             description="Gets the current weather in the provided list of locations.",
             parameters={"type": "object", "required": ["locations"], "properties": {
                 "locations": {"type": "array", "items": {"type": "string"},
                               "description": 'List of city and state, e.g. ["San Francisco, '
                                              'CA", "New York, NY"]'},
                 "format": FORMAT}}),
)
DOC_SYSTEM = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every "
    "message.\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>")
DOC_DEVELOPER = """<|start|>developer<|message|># Instructions

Use a friendly tone.

# Tools

## functions

namespace functions {

// Gets the location of the user.
type get_location = () => any;

// Gets the current weather in the provided location.
type get_current_weather = (_: {
// The city and state, e.g. San Francisco, CA
location: string,
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

// Gets the current weather in the provided list of locations.
type get_multiple_weathers = (_: {
// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]
locations: string[],
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

} // namespace functions<|end|>"""
DOC_USER = "<|start|>user<|message|>What is the weather like in SF?<|end|>"


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def test_the_documented_prompt_with_functions():
    messages = [ChatMessage(role="system", content="Use a friendly tone."),
                user("What is the weather like in SF?")]
    assert render_harmony(messages, DOC_TOOLS, "high", DAY) == \
        DOC_SYSTEM + DOC_DEVELOPER + DOC_USER + "<|start|>assistant"


def test_the_documented_tool_loop_keeps_its_reasoning():
    call = ToolCall(id="c1", name="get_weather", arguments='{"location":"San Francisco"}')
    messages = [ChatMessage(role="system", content="Use a friendly tone."),
                user("What is the weather like in SF?"),
                ChatMessage(role="assistant", content="", tool_calls=(call,),
                            reasoning="Need to use function get_weather."),
                ChatMessage(role="tool", content='{"sunny": true, "temperature": 20}',
                            tool_call_id="c1")]
    assert render_harmony(messages, DOC_TOOLS, "high", DAY) == (
        DOC_SYSTEM + DOC_DEVELOPER + DOC_USER +
        "<|start|>assistant<|channel|>analysis<|message|>Need to use function get_weather."
        "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"location":"San Francisco"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '{"sunny": true, "temperature": 20}<|end|><|start|>assistant')


def test_reasoning_before_a_final_answer_is_dropped():
    messages = [user("What is 2 + 2?"),
                ChatMessage(role="assistant", content="2 + 2 = 4.",
                            reasoning='User asks: "What is 2 + 2?" Simple arithmetic.'),
                user("What about 9 / 2?")]
    prompt = render_harmony(messages, (), None, DAY)
    assert "Reasoning: medium" in prompt and "functions" not in prompt
    assert "<|start|>developer" not in prompt  # no instructions, no tools
    assert prompt.endswith(
        "<|start|>user<|message|>What is 2 + 2?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|end|>"
        "<|start|>user<|message|>What about 9 / 2?<|end|><|start|>assistant")


@pytest.mark.parametrize("schema, expected", [
    ({"type": "integer"}, "number"),
    ({"type": ["string", "null"]}, "string | null"),
    ({"anyOf": [{"type": "boolean"}, {"const": 3}]}, "boolean | 3"),
    ({"type": "array", "items": {"enum": ["a", "b"]}}, 'Array<"a" | "b">'),
    ({"type": "object"}, "object"),
    ({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
     "{\nx: number,\n}"),
    ({}, "any"),
])
def test_schema_types(schema, expected):
    assert schema_type(schema) == expected


# ---- the reader -------------------------------------------------------------------------

REPLY = ("<|channel|>analysis<|message|>Think <a> bit.<|end|>"
         "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
         "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
         '<|message|>{"city": "Paris"}')


def read(text: str, splits=(), tools=("get_weather",)) -> list:
    counter = itertools.count()
    parser = HarmonyParser(tools, new_id=lambda: f"call_{next(counter)}")
    bounds = [0, *splits, len(text)]
    events: list = []
    for start, end in itertools.pairwise(bounds):
        events += parser.feed(text[start:end], final=end == len(text))
    merged: list = []
    for event in events:
        if merged and type(event) is type(merged[-1]) and not isinstance(event, ToolCall):
            merged[-1] = type(event)(merged[-1].text + event.text)
        else:
            merged.append(event)
    return merged


WHOLE = [Reasoning("Think <a> bit."), Answer("Checking."),
         ToolCall(id="call_0", name="get_weather", arguments='{"city": "Paris"}')]


def test_reasoning_preamble_and_call_are_told_apart():
    assert read(REPLY) == WHOLE


@pytest.mark.parametrize("split", range(1, len(REPLY)))
def test_any_split_reads_the_same(split):
    assert read(REPLY, (split,)) == WHOLE


def test_token_by_token_nothing_of_a_header_leaks():
    parser = HarmonyParser(["get_weather"])
    text = "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final" \
           "<|message|>b"
    for index, char in enumerate(text):
        for event in parser.feed(char, final=index == len(text) - 1):
            assert "<" not in event.text and "|" not in event.text


def test_a_recipient_in_the_role_part_of_the_header():
    text = ("<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_weather"
            '<|channel|>commentary <|constrain|>json<|message|>{"city": "Rome"}')
    assert read(text)[1] == ToolCall(id="call_0", name="get_weather",
                                     arguments='{"city": "Rome"}')


@pytest.mark.parametrize("text", [
    '<|channel|>commentary to=functions.unknown<|message|>{"a": 1}',
    "<|channel|>commentary to=functions.get_weather<|message|>not json",
    '<|channel|>analysis to=browser.search<|message|>{"query": "x"}',
])
def test_a_call_the_request_cannot_take_stays_reasoning(text):
    [event] = read(text)
    assert isinstance(event, Reasoning) and event.text.startswith("to=")


def test_a_reply_cut_short_in_a_header_shows_nothing():
    assert read("<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|chan") == \
        [Reasoning("hm")]


def test_a_reply_that_ignores_the_format_is_the_answer():
    assert read("Just text.") == [Answer("Just text.")]


def test_a_prefilled_header_reads_the_content_as_that_call():
    parser = HarmonyParser(["get_weather"], new_id=lambda: "c")
    parser.prefill("<|channel|>commentary to=functions.get_weather <|constrain|>json")
    assert parser.feed('{"city": "Oslo"}', final=True) == [
        ToolCall(id="c", name="get_weather", arguments='{"city": "Oslo"}')]


def output(text: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id="r", text=text, token_ids=(token,), finished=finished,
                         finish_reason="stop" if finished else None)


def test_the_stream_counts_reasoning_tokens_and_can_withhold_reasoning():
    pieces = ["<|channel|>analysis<|message|>", "a", "b", "<|end|>", "<|start|>assistant",
              "<|channel|>final<|message|>", "c"]
    for returned in (True, False):
        stream = HarmonyStream([], return_reasoning=returned)
        out = []
        for index, text in enumerate(pieces):
            out += stream.feed(output(text, index, finished=index == len(pieces) - 1))
        assert stream.reasoning_tokens == 3  # "a", "b" and the <|end|> closing them
        reasoning = [p for p in out if isinstance(p, ReasoningPiece)]
        assert ("".join(p.text for p in reasoning) == "ab") is returned
        assert [p.text for p in out if isinstance(p, TextPiece)] == ["c"]
        assert sum(len(p.token_ids) for p in out if not isinstance(p, IndexedCall)) == 7
        assert stream.finish_reason("stop") == "stop"


# ---- requests ---------------------------------------------------------------------------

WEATHER = ToolSpec(name="get_weather", parameters={
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


def request(**fields) -> GenerationRequest:
    return GenerationRequest(request_id="r", model="m", messages=(user("hi"),), **fields)


def test_a_named_tool_choice_writes_the_call_header_and_constrains_the_arguments():
    forced = forced_reply(request(tools=(WEATHER,), tool_choice=ForcedTool(name="get_weather")))
    assert forced.header == "<|channel|>commentary to=functions.get_weather <|constrain|>json"
    assert forced.grammar.json_schema["properties"] == {"city": {"type": "string"}}
    prompt = harmony_prompt(request(tools=(WEATHER,), tool_choice="required"), None)
    assert prompt.endswith("<|start|>assistant" + forced.header + "<|message|>")


def test_a_json_answer_is_forced_on_the_final_channel():
    forced = forced_reply(request(response_format=ResponseFormat(type="json_object")))
    assert forced.header == "<|channel|>final"
    assert forced_reply(request()) is None


@pytest.mark.parametrize("fields, param", [
    ({"tools": (WEATHER, ToolSpec(name="other")), "tool_choice": "required"}, "tool_choice"),
    ({"tools": (WEATHER,), "response_format": ResponseFormat(type="json_object")},
     "response_format"),
])
def test_forced_replies_harmony_cannot_express_are_refused(fields, param):
    with pytest.raises(InvalidParameter) as error:
        forced_reply(request(**fields))
    assert error.value.param == param


def test_the_files_own_template_gets_reasoning_effort_and_thinking():
    template = ChatTemplate(
        "{{ reasoning_effort }}|{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% if m.thinking %}({{ m.thinking }}){% endif %};{% endfor %}"
        "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}")
    call = ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}')
    messages = (user("hi"), ChatMessage(role="assistant", content="pre", tool_calls=(call,),
                                        reasoning="thought"),
                ChatMessage(role="tool", content="sunny", tool_call_id="c1"))

    def render(shaped, tools, variables):
        return template.render(shaped, tools=tools, **variables)

    prompt = harmony_prompt(GenerationRequest(
        request_id="r", model="m", messages=messages, tools=(WEATHER,),
        reasoning=ReasoningRequest(effort="low")), render)
    assert prompt == "low|user:hi;assistant:(thought);tool:sunny;get_weather"


def test_the_files_own_template_sees_one_call_per_assistant_turn():
    template = ChatTemplate("{% for m in messages %}{{ m.role }}"
                            "{% for c in m.tool_calls or [] %}[{{ c.function.name }}]{% endfor %}"
                            ";{% endfor %}")
    calls = tuple(ToolCall(id=f"c{n}", name=name, arguments="{}")
                  for n, name in enumerate(("a", "b")))
    messages = (user("hi"), ChatMessage(role="assistant", content="", tool_calls=calls))

    def render(shaped, tools, variables):
        return template.render(shaped, tools=tools, **variables)

    assert harmony_prompt(GenerationRequest(request_id="r", model="m", messages=messages),
                          render) == "user;assistant[a];assistant[b];"


def test_logprobs_are_the_answers_only():
    from shoal.engine.outputs import TokenLogprob

    stream = HarmonyStream([])
    texts = ["<|channel|>", "analysis", "<|message|>", "hm", "<|end|>", "<|start|>",
             "assistant", "<|channel|>", "final", "<|message|>", "Hi", " you"]
    out = []
    for index, text in enumerate(texts):
        out += stream.feed(RequestOutput(
            request_id="r", text=text, token_ids=(index,), finished=index == len(texts) - 1,
            logprobs=(TokenLogprob(token_id=index, token=text, logprob=-1.0),)))
    answer = [p for p in out if isinstance(p, TextPiece)]
    assert [lp.token for p in answer for lp in p.logprobs] == ["Hi", " you"]
    assert sum(len(p.token_ids) for p in out) == len(texts)
