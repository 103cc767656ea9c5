"""The Anthropic Messages API: a real node thread serving the fake engine, the official
`anthropic` client against it, and an in-process scripted router for mapping and tool use."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from fakes import ScriptedRouter, scripted_reply
from fastapi.testclient import TestClient

from shoal.api.app import create_app
from shoal.protocol import ForcedTool, ResponseFormat, ToolSpec

EIGHT_WORDS = "".join(f"w{i} " for i in range(1, 9))
BODY = {"model": "fake-model", "max_tokens": 100,
        "messages": [{"role": "user", "content": "hi there"}]}


def post(node, path, body):
    return httpx.post(node.url + path, json=body, timeout=20)


def sse(lines) -> list[tuple[str, dict]]:
    """(event name, data) pairs; every data line must follow its own event line."""
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: "):])
            assert data["type"] == name
            events.append((name, data))
    return events


# ---- over the fake engine -------------------------------------------------------------------

def test_message_shape(fake_node):
    response = post(fake_node, "/v1/messages", {**BODY, "system": [
        {"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("msg_") and body["type"] == "message"
    assert body["role"] == "assistant" and body["model"] == "fake-model"
    assert body["content"] == [{"type": "text", "text": EIGHT_WORDS}]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    assert body["usage"]["output_tokens"] == 8 and body["usage"]["input_tokens"] > 0


def test_stop_reasons(fake_node):
    short = post(fake_node, "/v1/messages", {**BODY, "max_tokens": 2}).json()
    assert short["stop_reason"] == "max_tokens" and short["content"][0]["text"] == "w1 w2 "
    stopped = post(fake_node, "/v1/messages", {**BODY, "stop_sequences": ["w3"]}).json()
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == "w3"
    assert stopped["content"][0]["text"] == "w1 w2 "


def test_stream_event_sequence(fake_node):
    with httpx.stream("POST", fake_node.url + "/v1/messages",
                      json={**BODY, "stream": True, "max_tokens": 3}, timeout=20) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse(response.iter_lines())
    names = [name for name, _ in events]
    assert names == ["message_start", "content_block_start", "ping",
                     *["content_block_delta"] * 3, "content_block_stop", "message_delta",
                     "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] > 0
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert text == "w1 w2 w3 "
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 3


def test_count_tokens(fake_node):
    one = post(fake_node, "/v1/messages/count_tokens", {"model": "fake-model",
                                                        "messages": BODY["messages"]})
    assert one.status_code == 200, one.text
    longer = post(fake_node, "/v1/messages/count_tokens", {
        "model": "fake", "system": "be brief",
        "messages": [*BODY["messages"], {"role": "assistant", "content": "ok"},
                     {"role": "user", "content": "more words here"}]})
    # The fake engine renders "role: content" turns and counts words.
    assert one.json() == {"input_tokens": 4}
    assert longer.json() == {"input_tokens": 4 + 3 + 2 + 4}
    generated = post(fake_node, "/v1/messages", BODY).json()
    assert generated["usage"]["input_tokens"] == one.json()["input_tokens"]


@pytest.mark.parametrize("body,param", [
    ({k: v for k, v in BODY.items() if k != "max_tokens"}, "max_tokens"),
    ({**BODY, "max_tokens": 0}, "max_tokens"),
    ({**BODY, "temperature": 1.5}, "temperature"),
    ({**BODY, "top_p": 0}, "top_p"),
    ({**BODY, "messages": []}, "messages"),
    ({**BODY, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({**BODY, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": "aGk="}}]}]},
     "messages.0.content.0.source.data: the image is not a PNG"),
    ({**BODY, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking.budget_tokens must be less than max_tokens"),
    ({**BODY, "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking: model 'fake-model' does not support reasoning"),
    ({**BODY, "thinking": {"type": "enabled", "budget_tokens": 10}}, "at least 1024"),
    ({**BODY, "thinking": {"type": "sometimes"}}, "thinking.type"),
    ({**BODY, "output_config": {"effort": "high"}}, "effort: model 'fake-model' does not"),
    ({**BODY, "output_config": {"effort": "max"}}, "output_config.effort"),
    ({**BODY, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
    ({**BODY, "tool_choice": {"type": "tool", "name": "missing"}}, "missing"),
])
def test_bad_input_is_400_invalid_request_error(fake_node, body, param):
    response = post(fake_node, "/v1/messages", body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert param in error["error"]["message"]


def test_error_statuses(fake_node):
    unknown = post(fake_node, "/v1/messages", {**BODY, "model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    counted = post(fake_node, "/v1/messages/count_tokens", {"model": "nope",
                                                            "messages": BODY["messages"]})
    assert counted.status_code == 404
    crashed = post(fake_node, "/v1/messages", {**BODY, "messages": [
        {"role": "user", "content": "RAISE"}]})
    assert crashed.status_code == 500 and crashed.json()["error"]["type"] == "api_error"
    bad_json = httpx.post(fake_node.url + "/v1/messages", content=b"{nope",
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["type"] == "invalid_request_error"


def test_overload_is_529_overloaded_error(fake_node):
    slow = {**BODY, "stream": True, "messages": [{"role": "user", "content": "FOREVER SLOW"}]}
    with httpx.Client(timeout=20) as client:
        streams = [client.send(client.build_request("POST", fake_node.url + "/v1/messages",
                                                    json=slow), stream=True)
                   for _ in range(4)]
        refused = client.post(fake_node.url + "/v1/messages", json=BODY)
        for response in streams:
            response.close()
    assert refused.status_code == 529
    assert refused.json()["error"]["type"] == "overloaded_error"


def test_official_client(fake_node):
    client = anthropic.Anthropic(base_url=fake_node.url, api_key="unused", max_retries=0)
    message = client.messages.create(**BODY)
    assert message.content[0].text == EIGHT_WORDS and message.stop_reason == "end_turn"
    with client.messages.stream(**{**BODY, "max_tokens": 4}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == "w1 w2 w3 w4 " and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 4
    assert client.messages.count_tokens(model="fake-model",
                                        messages=BODY["messages"]).input_tokens == 4
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**{**BODY, "model": "nope"})
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(**BODY, extra_body={"temperature": 1.5})


# ---- mapping and tool use (scripted router, in-process) -------------------------------------

WEATHER = {"name": "weather", "description": "Weather now",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def scripted(script=None):
    router = ScriptedRouter(script)
    return router, TestClient(create_app(router, list_available=list))


def test_tools_and_tool_results_map_to_the_internal_request():
    router, client = scripted()
    history = [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "x"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "-3C"}]},
            {"type": "text", "text": "And Bergen?"}]},
    ]
    response = client.post("/v1/messages", json={
        **BODY, "messages": history, "tools": [WEATHER], "temperature": 0.2, "top_k": 5,
        "tool_choice": {"type": "tool", "name": "weather"}, "metadata": {"user_id": "u1"}})
    assert response.status_code == 200, response.text
    internal = router.requests[-1]
    assert internal.tools == (ToolSpec(name="weather", description="Weather now",
                                       parameters=WEATHER["input_schema"]),)
    assert internal.tool_choice == ForcedTool(name="weather")
    roles = [m.role for m in internal.messages]
    assert roles == ["user", "assistant", "tool", "user"]
    assistant = internal.messages[1]
    assert assistant.content == "Let me check."
    assert assistant.tool_calls[0].id == "toolu_1"
    assert json.loads(assistant.tool_calls[0].arguments) == {"city": "Oslo"}
    assert internal.messages[2].tool_call_id == "toolu_1"
    assert internal.messages[2].content == "-3C"
    assert (internal.sampling.temperature, internal.sampling.top_k) == (0.2, 5)
    assert internal.response_format is None
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    client.post("/v1/messages", json={**BODY, "output_config": {
        "format": {"type": "json_schema", "schema": schema}}})
    assert router.requests[-1].response_format == ResponseFormat(type="json_schema",
                                                                 json_schema=schema)
    for choice, expected in (({"type": "any"}, "required"), ({"type": "none"}, "none"),
                             ({"type": "auto"}, "auto")):
        client.post("/v1/messages", json={**BODY, "tools": [WEATHER], "tool_choice": choice})
        assert router.requests[-1].tool_choice == expected


def test_tool_use_blocks_json_and_stream():
    calls = [("weather", '{"city": "Oslo"}'), ("weather", '{"city": "Bergen"}')]
    _, client = scripted(lambda request: scripted_reply(request, ["Checking."], calls))
    message = client.post("/v1/messages", json={**BODY, "tools": [WEATHER]}).json()
    assert message["stop_reason"] == "tool_use"
    assert [b["type"] for b in message["content"]] == ["text", "tool_use", "tool_use"]
    assert message["content"][1] == {"type": "tool_use", "id": "call_0", "name": "weather",
                                     "input": {"city": "Oslo"}}
    single = client.post("/v1/messages", json={
        **BODY, "tools": [WEATHER],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}).json()
    assert [b["type"] for b in single["content"]] == ["text", "tool_use"]
    with client.stream("POST", "/v1/messages", json={**BODY, "stream": True}) as response:
        events = sse(response.iter_lines())
    assert [name for name, _ in events] == [
        "message_start", "content_block_start", "ping", "content_block_delta",
        "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert events[5][1]["content_block"] == {"type": "tool_use", "id": "call_0",
                                             "name": "weather", "input": {}}
    assert events[6][1]["index"] == 1
    assert json.loads(events[6][1]["delta"]["partial_json"]) == {"city": "Oslo"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_official_client_accumulates_tool_use():
    calls = [("weather", '{"city": "Oslo"}')]
    _, client = scripted(lambda request: scripted_reply(request, [], calls))
    sdk = anthropic.Anthropic(base_url="http://testserver", api_key="unused",
                              http_client=client)
    with sdk.messages.stream(**{**BODY, "tools": [WEATHER]}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "weather", {"city": "Oslo"})]


def crash_midway(request):
    from shoal.protocol import ErrorChunk

    return scripted_reply(request, ["partial"])[:2] + [ErrorChunk(
        request_id=request.request_id, code="runner_crashed", message="the runner died")]


def test_error_mid_stream_is_an_error_event():
    _, client = scripted(crash_midway)
    with client.stream("POST", "/v1/messages", json={**BODY, "stream": True}) as response:
        events = sse(response.iter_lines())
    assert [name for name, _ in events][-2:] == ["content_block_delta", "error"]
    assert events[-1][1]["error"] == {"type": "api_error", "message": "the runner died"}
    sdk = anthropic.Anthropic(base_url="http://testserver", api_key="unused",
                              http_client=client, max_retries=0)
    with pytest.raises(anthropic.APIStatusError, match="the runner died"), \
            sdk.messages.stream(**BODY) as stream:
        stream.get_final_message()
    whole = client.post("/v1/messages", json=BODY)
    assert whole.status_code == 503 and whole.json()["error"]["type"] == "api_error"
