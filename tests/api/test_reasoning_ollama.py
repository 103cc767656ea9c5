"""A reasoning model (harmony, tests/fakes.py's "fake-harmony") through the Ollama dialect:
reasoning in message.thinking (/api/chat) and thinking (/api/generate), never in the answer;
think true / false / an effort; a tool-calling conversation with its thinking round-trips."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

WEATHER_TOOL = {"type": "function",
                "function": {"name": "get_weather", "description": "Weather in a city",
                             "parameters": {"type": "object",
                                            "properties": {"city": {"type": "string"}},
                                            "required": ["city"]}}}


def post(node, path, body):
    return httpx.post(node.url + path, json={"stream": False, **body}, timeout=20)


def lines(node, path, body) -> list[dict]:
    with httpx.stream("POST", node.url + path, json={**body, "stream": True},
                      timeout=20) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line) for line in response.iter_lines() if line]


def chat(content, **extra):
    return {"model": "fake-harmony", "messages": [{"role": "user", "content": content}],
            **extra}


@pytest.mark.parametrize("think", [True, "high", None])
def test_chat_thinking_comes_back_apart(fake_node, think):
    response = post(fake_node, "/api/chat", chat("THINK hi", think=think))
    assert response.status_code == 200, response.text
    message = response.json()["message"]
    assert message == {"role": "assistant", "content": "Hello there!",
                       "thinking": "The user greets me. Reply kindly."}


def test_show_lists_thinking_once_the_model_is_loaded(fake_node):
    assert post(fake_node, "/api/chat", chat("THINK hi")).status_code == 200
    shown = post(fake_node, "/api/show", {"model": "fake-harmony"}).json()
    assert shown["capabilities"] == ["completion", "tools", "thinking"]
    plain = post(fake_node, "/api/show", {"model": "fake-model"}).json()
    assert "thinking" not in plain["capabilities"]


def test_think_false_returns_no_thinking(fake_node):
    body = post(fake_node, "/api/chat", chat("THINK hi", think=False)).json()
    assert body["message"] == {"role": "assistant", "content": "Hello there!"}
    assert body["eval_count"] == 6  # its reasoning was still written, and counted


def test_streamed_thinking_never_mixes_with_content(fake_node):
    parts = lines(fake_node, "/api/chat", chat("THINK hi", think=True))
    messages = [p["message"] for p in parts]
    assert "".join(m.get("thinking", "") for m in messages) == \
        "The user greets me. Reply kindly."
    assert "".join(m["content"] for m in messages) == "Hello there!"
    assert not any(m["content"] and m.get("thinking") for m in messages)
    assert parts[-1]["done"] is True


def test_generate_returns_thinking(fake_node):
    body = post(fake_node, "/api/generate", {"model": "fake-harmony", "prompt": "THINK hi",
                                             "think": "low"}).json()
    assert body["response"] == "Hello there!"
    assert body["thinking"] == "The user greets me. Reply kindly."
    streamed = lines(fake_node, "/api/generate", {"model": "fake-harmony",
                                                  "prompt": "THINK hi"})
    assert "".join(p.get("thinking", "") for p in streamed) == \
        "The user greets me. Reply kindly."
    assert "".join(p["response"] for p in streamed) == "Hello there!"


def test_raw_generate_cannot_think(fake_node):
    response = post(fake_node, "/api/generate", {"model": "fake-harmony", "prompt": "hi",
                                                 "raw": True, "think": True})
    assert response.status_code == 400 and "think" in response.json()["error"]


def test_a_tool_call_with_thinking_round_trips(fake_node):
    first = post(fake_node, "/api/chat", chat("THINKCALL weather?", tools=[WEATHER_TOOL],
                                              think=True)).json()
    message = first["message"]
    assert message["thinking"] == "Need the weather in Paris."
    assert message["content"] == ""
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == {"city": "Paris"}
    history = [{"role": "user", "content": "THINKCALL weather?"}, message,
               {"role": "tool", "tool_name": "get_weather", "content": '{"sky": "sunny"}'}]
    second = post(fake_node, "/api/chat", {"model": "fake-harmony", "messages": history,
                                           "tools": [WEATHER_TOOL], "think": True}).json()
    assert second["message"]["content"] == "Sunny in Paris, 22 C."
    assert second["message"]["thinking"] == "It is sunny there."


def test_the_ollama_client_reads_thinking(fake_node):
    client = ollama.Client(host=fake_node.url)
    reply = client.chat(model="fake-harmony", think="medium",
                        messages=[{"role": "user", "content": "THINK hi"}])
    assert reply.message.thinking == "The user greets me. Reply kindly."
    assert reply.message.content == "Hello there!"
    streamed = list(client.chat(model="fake-harmony", think=True, stream=True,
                                messages=[{"role": "user", "content": "THINKCALL weather?"}],
                                tools=[WEATHER_TOOL]))
    assert "".join(p.message.thinking or "" for p in streamed) == "Need the weather in Paris."
    [call] = [c for p in streamed for c in p.message.tool_calls or ()]
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    generated = client.generate(model="fake-harmony", prompt="THINK hi", think=True)
    assert generated.thinking == "The user greets me. Reply kindly."
    assert generated.response == "Hello there!"
