"""Structured output and forced tool calls from a real `shoal serve` (SmolLM2 135M), driven
by the official openai client: every answer parses and validates, streamed or not (slow)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from serve_process import start_serve

pytestmark = pytest.mark.slow

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "colour": {"enum": ["red", "green", "blue"]},
                         "pets": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                  "maxItems": 2}},
          "required": ["name", "age", "colour", "pets"]}
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 40},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 10**6},
                                        "b": {"type": "integer", "maximum": 10**6}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "Current weather in a city"}},
         {"type": "function", "function": {"name": "add", "parameters": ADD,
                                           "description": "Add two integers"}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    node = start_serve(["--standalone", "--model", "smollm2", "--threads", "2",
                        "--kv-cache-memory", "128MiB"], tmp_path_factory.mktemp("shoal-data"))
    yield openai.OpenAI(base_url=node.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    node.stop()


def _streamed(stream) -> tuple[str, dict[int, dict], str | None]:
    """(content, tool calls merged by index, finish_reason) from a chat stream."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_json_schema_output_validates_streamed_and_not(client):
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Invent a person and describe them."}]
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=80,
                                           temperature=0, response_format=response_format)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
    content, calls, finish = _streamed(client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=80, temperature=0.8, seed=5,
        response_format=response_format, stream=True))
    assert finish == "stop" and not calls
    jsonschema.validate(json.loads(content), PERSON)


def test_json_object_output_parses(client):
    reply = client.chat.completions.create(
        model="smollm2", max_tokens=60, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}])
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_forced_tool_call_parses_and_validates(client):
    reply = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "add"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id
    jsonschema.validate(json.loads(call.function.arguments), ADD)


def test_required_tool_call_streams_as_deltas(client):
    content, calls, finish = _streamed(client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60,
        temperature=0, stream=True))
    assert finish == "tool_calls" and not content
    [call] = calls.values()
    assert call["id"] and call["name"] in ("get_weather", "add")
    schema = WEATHER if call["name"] == "get_weather" else ADD
    jsonschema.validate(json.loads(call["arguments"]), schema)


def test_a_schema_the_engine_cannot_enforce_is_400(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model="smollm2", messages=ASK, max_tokens=5,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert error.value.body["param"] == "response_format"
    assert "nonsense" in error.value.body["message"]
