"""A model that reasons between <think> tags (tests/fakes.py's "fake-think", a template like
Qwen3's) through the three dialects: reasoning apart from the answer, enable_thinking from
the request, tool calls after the reasoning round-tripping."""

from __future__ import annotations

import json

import httpx

THOUGHT = "The user greets me. Reply kindly."
WEATHER_TOOL = {"type": "function",
                "function": {"name": "get_weather", "description": "Weather in a city",
                             "parameters": {"type": "object",
                                            "properties": {"city": {"type": "string"}},
                                            "required": ["city"]}}}


def post(node, path, body):
    return httpx.post(node.url + path, json={"model": "fake-think", **body}, timeout=20)


def user(text):
    return [{"role": "user", "content": text}]


def test_openai_reasoning_content_and_a_tool_round_trip(fake_node):
    reply = post(fake_node, "/v1/chat/completions", {"messages": user("THINK hi")}).json()
    message = reply["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, "Hello there!")
    first = post(fake_node, "/v1/chat/completions", {"messages": user("THINKCALL weather?"),
                                                     "tools": [WEATHER_TOOL]}).json()
    message = first["choices"][0]["message"]
    assert message["reasoning_content"] == "Need the weather in Paris."
    [call] = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    history = [*user("THINKCALL weather?"), message,
               {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    second = post(fake_node, "/v1/chat/completions", {"messages": history,
                                                      "tools": [WEATHER_TOOL]}).json()
    answer = second["choices"][0]["message"]
    assert (answer["reasoning_content"], answer["content"]) == \
        ("It is sunny there.", "Sunny in Paris, 22 C.")


def test_openai_streamed_reasoning_never_leaks_a_tag(fake_node):
    with httpx.stream("POST", fake_node.url + "/v1/chat/completions", timeout=20,
                      json={"model": "fake-think", "messages": user("THINK hi"),
                            "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.get("content") or "" for d in deltas) == "Hello there!"


def test_ollama_think_false_turns_thinking_off(fake_node):
    on = post(fake_node, "/api/chat", {"messages": user("THINK hi"), "stream": False,
                                       "think": True}).json()
    assert on["message"]["thinking"] == THOUGHT
    off = post(fake_node, "/api/chat", {"messages": user("THINK hi"), "stream": False,
                                        "think": False}).json()
    assert off["message"] == {"role": "assistant", "content": "Hello there!"}
    assert off["eval_count"] == 2  # the template closed the block: nothing was reasoned


def test_anthropic_thinking_blocks(fake_node):
    message = post(fake_node, "/v1/messages", {
        "max_tokens": 60, "messages": user("THINK hi"),
        "thinking": {"type": "adaptive"}}).json()
    assert message["content"] == [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                                  {"type": "text", "text": "Hello there!"}]
