"""A reasoning model (harmony, tests/fakes.py's "fake-harmony") through Anthropic's Messages
dialect: with thinking enabled its reasoning comes back as thinking blocks (streamed as
thinking_delta), never in the text; without it, no thinking; earlier thinking blocks and
tool calls round-trip."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
THINKING = {"type": "enabled", "budget_tokens": 1024}
THOUGHT = "The user greets me. Reply kindly."


def body(content, **extra):
    return {"model": "fake-harmony", "max_tokens": 2048,
            "messages": [{"role": "user", "content": content}], **extra}


def post(node, payload):
    return httpx.post(node.url + "/v1/messages", json=payload, timeout=20)


def events(node, payload) -> list[tuple[str, dict]]:
    with httpx.stream("POST", node.url + "/v1/messages", json={**payload, "stream": True},
                      timeout=20) as response:
        assert response.status_code == 200, response.read()
        lines = list(response.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    return list(zip(names, datas, strict=True))


def test_thinking_blocks_come_first_and_apart(fake_node):
    response = post(fake_node, body("THINK hi", thinking=THINKING))
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["content"] == [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                                  {"type": "text", "text": "Hello there!"}]
    assert message["stop_reason"] == "end_turn"


@pytest.mark.parametrize("extra", [{}, {"thinking": {"type": "disabled"}},
                                   {"output_config": {"effort": "low"}}])
def test_without_thinking_only_the_answer_comes_back(fake_node, extra):
    message = post(fake_node, body("THINK hi", **extra)).json()
    assert message["content"] == [{"type": "text", "text": "Hello there!"}]


def test_streamed_thinking_is_its_own_block(fake_node):
    stream = events(fake_node, body("THINK hi", thinking=THINKING))
    starts = [d["content_block"]["type"] for name, d in stream if name == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [d["delta"] for name, d in stream if name == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == THOUGHT
    assert "".join(d.get("text", "") for d in deltas) == "Hello there!"
    assert {"type": "signature_delta", "signature": ""} in deltas
    thinking_index = next(d["index"] for name, d in stream if name == "content_block_start")
    assert all(d["delta"]["type"] in ("thinking_delta", "signature_delta")
               for name, d in stream
               if name == "content_block_delta" and d["index"] == thinking_index)


def test_a_tool_call_with_thinking_round_trips(fake_node):
    first = post(fake_node, body("THINKCALL weather?", thinking=THINKING, tools=[WEATHER]))
    assert first.status_code == 200, first.text
    reply = first.json()
    assert reply["stop_reason"] == "tool_use"
    thinking, tool_use = reply["content"]
    assert thinking["thinking"] == "Need the weather in Paris."
    assert tool_use["name"] == "get_weather" and tool_use["input"] == {"city": "Paris"}
    history = [{"role": "user", "content": "THINKCALL weather?"},
               {"role": "assistant", "content": reply["content"]},
               {"role": "user", "content": [{"type": "tool_result",
                                             "tool_use_id": tool_use["id"],
                                             "content": '{"sky": "sunny"}'}]}]
    second = post(fake_node, {"model": "fake-harmony", "max_tokens": 2048,
                              "thinking": THINKING, "tools": [WEATHER], "messages": history})
    assert second.status_code == 200, second.text
    assert second.json()["content"] == [
        {"type": "thinking", "thinking": "It is sunny there.", "signature": ""},
        {"type": "text", "text": "Sunny in Paris, 22 C."}]


def test_the_anthropic_client_reads_thinking(fake_node):
    client = anthropic.Anthropic(base_url=fake_node.url, api_key="unused")
    message = client.messages.create(model="fake-harmony", max_tokens=2048, thinking=THINKING,
                                     messages=[{"role": "user", "content": "THINK hi"}])
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == THOUGHT
    with client.messages.stream(model="fake-harmony", max_tokens=2048, thinking=THINKING,
                                tools=[WEATHER], messages=[{"role": "user",
                                                            "content": "THINKCALL weather?"}]
                                ) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == "Need the weather in Paris."
    assert final.content[1].input == {"city": "Paris"}
