"""A reasoning model (harmony, gpt-oss's format) through the OpenAI dialect: reasoning comes
back in reasoning_content, never in the answer, and a tool-calling conversation with its
reasoning round-trips. The fake engine's "fake-harmony" model writes scripted harmony
replies (tests/fakes.py: THINK, THINKCALL, and AFTERCALL once a tool result is present)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

WEATHER_TOOL = {"type": "function",
                "function": {"name": "get_weather", "description": "Weather in a city",
                             "parameters": {"type": "object",
                                            "properties": {"city": {"type": "string"}},
                                            "required": ["city"]}}}


def post(node, body):
    return httpx.post(node.url + "/v1/chat/completions", json=body, timeout=20)


def sse_deltas(node, body) -> list[dict]:
    with httpx.stream("POST", node.url + "/v1/chat/completions",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=20) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def chat(content, **extra):
    return {"model": "fake-harmony", "messages": [{"role": "user", "content": content}],
            **extra}


def test_reasoning_comes_back_apart_from_the_answer(fake_node):
    response = post(fake_node, chat("THINK hello", reasoning_effort="high"))
    assert response.status_code == 200, response.text
    body = response.json()
    message = body["choices"][0]["message"]
    assert message["content"] == "Hello there!"
    assert message["reasoning_content"] == "The user greets me. Reply kindly."
    assert body["choices"][0]["finish_reason"] == "stop"
    assert 0 < body["usage"]["completion_tokens_details"]["reasoning_tokens"] \
        < body["usage"]["completion_tokens"]


def test_streamed_reasoning_is_its_own_delta_and_no_header_leaks(fake_node):
    events = sse_deltas(fake_node, chat("THINK hello"))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    assert content == "Hello there!"
    assert reasoning == "The user greets me. Reply kindly."
    assert not any("content" in d and "reasoning_content" in d for d in deltas)
    assert events[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def test_a_tool_call_with_reasoning_round_trips(fake_node):
    first = post(fake_node, chat("THINKCALL weather in Paris?", tools=[WEATHER_TOOL]))
    assert first.status_code == 200, first.text
    choice = first.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "Need the weather in Paris."
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    history = [{"role": "user", "content": "THINKCALL weather in Paris?"}, message,
               {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "sunny"}'}]
    second = post(fake_node, {"model": "fake-harmony", "messages": history,
                              "tools": [WEATHER_TOOL]})
    assert second.status_code == 200, second.text
    answer = second.json()["choices"][0]["message"]
    assert answer["content"] == "Sunny in Paris, 22 C."
    assert answer["reasoning_content"] == "It is sunny there."


def test_a_streamed_tool_call_keeps_reasoning_apart(fake_node):
    events = sse_deltas(fake_node, chat("THINKCALL weather?", tools=[WEATHER_TOOL]))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == \
        "Need the weather in Paris."
    [calls] = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("effort", ["extreme", 3, ""])
def test_a_bad_reasoning_effort_is_a_400(fake_node, effort):
    response = post(fake_node, chat("THINK hi", reasoning_effort=effort))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "reasoning_effort"


def test_reasoning_effort_on_a_model_without_reasoning_is_refused(fake_node):
    response = post(fake_node, {"model": "fake-model", "reasoning_effort": "low",
                                "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "reasoning_effort" and "does not support reasoning" in \
        error["message"]


def test_the_openai_client_reads_reasoning_content(fake_node):
    client = openai.OpenAI(base_url=fake_node.url + "/v1", api_key="unused")
    completion = client.chat.completions.create(
        model="fake-harmony", reasoning_effort="low",
        messages=[{"role": "user", "content": "THINK hello"}])
    message = completion.choices[0].message
    assert message.content == "Hello there!"
    assert message.reasoning_content == "The user greets me. Reply kindly."
    assert completion.usage.completion_tokens_details.reasoning_tokens > 0
    stream = client.chat.completions.create(
        model="fake-harmony", stream=True,
        messages=[{"role": "user", "content": "THINK hello"}])
    pieces = [(getattr(c.choices[0].delta, "reasoning_content", None),
               c.choices[0].delta.content) for c in stream if c.choices]
    assert "".join(r or "" for r, _ in pieces) == "The user greets me. Reply kindly."
    assert "".join(t or "" for _, t in pieces) == "Hello there!"


# ---- the Responses API ------------------------------------------------------------------

def respond(node, body):
    return httpx.post(node.url + "/v1/responses", json={"model": "fake-harmony", **body},
                      timeout=20)


def test_responses_return_a_reasoning_item_before_the_message(fake_node):
    response = respond(fake_node, {"input": "THINK hi", "reasoning": {"effort": "high"}})
    assert response.status_code == 200, response.text
    body = response.json()
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text",
                                     "text": "The user greets me. Reply kindly."}]
    assert message["content"][0]["text"] == "Hello there!"
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    assert body["reasoning"]["effort"] == "high"
    quiet = respond(fake_node, {"input": "THINK hi", "reasoning": {"effort": "none"}}).json()
    assert [item["type"] for item in quiet["output"]] == ["message"]
    bad = respond(fake_node, {"input": "THINK hi", "reasoning": {"effort": "max"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning.effort"


def test_responses_round_trip_reasoning_and_a_call(fake_node):
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    first = respond(fake_node, {"input": "THINKCALL weather?", "tools": [tool]}).json()
    reasoning, call = first["output"]
    assert reasoning["content"][0]["text"] == "Need the weather in Paris."
    assert call["type"] == "function_call" and call["arguments"] == '{"city": "Paris"}'
    history = [{"role": "user", "content": "THINKCALL weather?"}, reasoning, call,
               {"type": "function_call_output", "call_id": call["call_id"],
                "output": '{"sky": "sunny"}'}]
    second = respond(fake_node, {"input": history, "tools": [tool]})
    assert second.status_code == 200, second.text
    output = second.json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[1]["content"][0]["text"] == "Sunny in Paris, 22 C."


def test_the_openai_client_streams_responses_reasoning(fake_node):
    client = openai.OpenAI(base_url=fake_node.url + "/v1", api_key="unused")
    with client.responses.stream(model="fake-harmony", input="THINK hi",
                                 reasoning={"effort": "low"}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert final.output[0].type == "reasoning"
    assert final.output[0].content[0].text == "The user greets me. Reply kindly."
    assert final.output_text == "Hello there!"
