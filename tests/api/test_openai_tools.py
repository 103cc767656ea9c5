"""OpenAI tools and response formats over a real node serving the fake engine.

The fake engine writes "Let me check. " and a tagged get_weather call when the prompt holds
TOOLCALL, split across pieces; the runner's parser must turn it into tool_calls.
"""

from __future__ import annotations

import json

import httpx
import pytest

WEATHER_TOOL = {"type": "function",
                "function": {"name": "get_weather", "description": "Weather in a city",
                             "parameters": {"type": "object",
                                            "properties": {"city": {"type": "string"}},
                                            "required": ["city"]}}}
CALL = {"model": "fake-model", "messages": [{"role": "user", "content": "TOOLCALL please"}],
        "tools": [WEATHER_TOOL]}


def post(node, body):
    return httpx.post(node.url + "/v1/chat/completions", json=body, timeout=20)


def sse_chunks(node, body) -> list[dict]:
    with httpx.stream("POST", node.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=20) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_tool_call_becomes_message_tool_calls(fake_node):
    response = post(fake_node, CALL)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check. "
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_streamed_tool_call_is_one_delta_and_no_raw_json_leaks(fake_node):
    chunks = sse_chunks(fake_node, CALL)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    text = "".join(d.get("content") or "" for d in deltas)
    assert text == "Let me check. "
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1
    [call] = calls[0]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert call["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("extra", [{"tools": None}, {"tool_choice": "none"}])
def test_without_offered_tools_the_text_is_left_alone(fake_node, extra):
    body = {key: value for key, value in {**CALL, **extra}.items() if value is not None}
    choice = post(fake_node, body).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert "<tool_call>" in choice["message"]["content"]


def test_history_with_tool_calls_and_results_is_accepted(fake_node):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
    ]
    response = post(fake_node, {**CALL, "messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_json_response_formats_are_accepted(fake_node):
    for response_format in ({"type": "json_object"}, {"type": "text"},
                            {"type": "json_schema",
                             "json_schema": {"name": "x", "strict": True,
                                             "schema": {"type": "object"}}}):
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "response_format": response_format}
        assert post(fake_node, body).status_code == 200, response_format


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "3"}]},
     "messages.1.tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
])
def test_invalid_tool_and_format_fields_are_400_naming_the_parameter(fake_node, extra, param):
    body = {key: value for key, value in {**CALL, **extra}.items() if value is not None}
    response = post(fake_node, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
