"""OpenAI's Responses API (/v1/responses): a real node thread serving the fake engine, the
official `openai` client against it, and an in-process scripted router for function calls."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fakes import ScriptedRouter, scripted_reply
from fastapi.testclient import TestClient

from shoal.api.app import create_app
from shoal.protocol import ForcedTool, ResponseFormat, ToolSpec

EIGHT_WORDS = "".join(f"w{i} " for i in range(1, 9))
BODY = {"model": "fake-model", "input": "hi there"}
STREAM_OPENING = ["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added"]
STREAM_CLOSING = ["response.output_text.done", "response.content_part.done",
                  "response.output_item.done"]


def post(node, body):
    return httpx.post(node.url + "/v1/responses", json=body, timeout=20)


def sse(lines) -> list[dict]:
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: "):])
            assert data["type"] == name
            events.append(data)
    return events


# ---- over the fake engine -------------------------------------------------------------------

def test_response_object(fake_node):
    response = post(fake_node, {**BODY, "instructions": "be brief", "metadata": {"k": "v"}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert body["status"] == "completed" and body["error"] is None
    assert body["model"] == "fake-model" and body["metadata"] == {"k": "v"}
    assert body["instructions"] == "be brief" and body["store"] is False
    [message] = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["status"] == "completed" and message["id"].startswith("msg_")
    assert message["content"] == [{"type": "output_text", "text": EIGHT_WORDS,
                                   "annotations": [], "logprobs": []}]
    usage = body["usage"]
    assert usage["output_tokens"] == 8
    assert usage["total_tokens"] == usage["input_tokens"] + 8


def test_max_output_tokens_makes_it_incomplete(fake_node):
    body = post(fake_node, {**BODY, "max_output_tokens": 2}).json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == "w1 w2 "


def test_stream_event_sequence(fake_node):
    with httpx.stream("POST", fake_node.url + "/v1/responses",
                      json={**BODY, "stream": True, "max_output_tokens": 3},
                      timeout=20) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse(response.iter_lines())
    assert [e["type"] for e in events] == [
        *STREAM_OPENING, *["response.output_text.delta"] * 3, *STREAM_CLOSING,
        "response.incomplete"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress"
    item_id = events[2]["item"]["id"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert all(e["item_id"] == item_id and e["output_index"] == 0 for e in deltas)
    assert "".join(e["delta"] for e in deltas) == "w1 w2 w3 "
    assert events[-4]["text"] == "w1 w2 w3 "
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "w1 w2 w3 "
    assert final["usage"]["output_tokens"] == 3


def test_stream_completes(fake_node):
    with httpx.stream("POST", fake_node.url + "/v1/responses", json={**BODY, "stream": True},
                      timeout=20) as response:
        events = sse(response.iter_lines())
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["status"] == "completed"


@pytest.mark.parametrize("body,param", [
    ({**BODY, "max_output_tokens": 0}, "max_output_tokens"),
    ({**BODY, "temperature": 500}, "temperature"),
    ({**BODY, "previous_response_id": "resp_1"}, "previous_response_id"),
    ({**BODY, "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({**BODY, "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({**BODY, "input": [{"role": "user", "content": [
        {"type": "input_file", "file_id": "file-1"}]}]}, "input.0.content.0.type"),
    ({**BODY, "input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({**BODY, "input": [{"type": "message", "content": "x"}]}, "input.0.role"),
    ({**BODY, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"model": "fake-model"}, "input"),
])
def test_bad_input_is_400_in_openai_shape(fake_node, body, param):
    response = post(fake_node, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_unknown_model_is_404(fake_node):
    response = post(fake_node, {**BODY, "model": "nope"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_official_client(fake_node):
    client = openai.OpenAI(base_url=fake_node.url + "/v1", api_key="unused", max_retries=0)
    reply = client.responses.create(model="fake-model", input="hi", max_output_tokens=4)
    assert reply.output_text == "w1 w2 w3 w4 " and reply.status == "incomplete"
    with client.responses.stream(model="fake", input=[
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]) as stream:
        streamed = "".join(event.delta for event in stream
                           if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert streamed == final.output_text == EIGHT_WORDS
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="hi")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="fake-model", input="hi", top_p=7)


# ---- mapping and function calls (scripted router, in-process) -------------------------------

WEATHER = {"type": "function", "name": "weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def scripted(script=None):
    router = ScriptedRouter(script)
    return router, TestClient(create_app(router, list_available=list))


def test_input_items_tools_and_format_map_to_the_internal_request():
    router, client = scripted()
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_9", "name": "weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_9", "output": "-3C"},
    ]
    response = client.post("/v1/responses", json={
        "model": "m", "input": items, "instructions": "You are terse.", "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "weather"}, "temperature": 0.3,
        "top_p": 0.8, "max_output_tokens": 50,
        "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}})
    assert response.status_code == 200, response.text
    internal = router.requests[-1]
    assert [m.role for m in internal.messages] == ["system", "system", "user", "assistant",
                                                   "tool"]
    assert internal.messages[0].content == "You are terse."
    assert internal.messages[3].tool_calls[0].id == "call_9"
    assert internal.messages[4].tool_call_id == "call_9" and internal.messages[4].content == "-3C"
    assert internal.tools == (ToolSpec(name="weather", description="Weather now",
                                       parameters=WEATHER["parameters"]),)
    assert internal.tool_choice == ForcedTool(name="weather")
    assert internal.response_format == ResponseFormat(type="json_schema", json_schema=schema)
    s = internal.sampling
    assert (s.temperature, s.top_p, s.max_tokens) == (0.3, 0.8, 50)
    echoed = response.json()
    assert echoed["tool_choice"] == {"type": "function", "name": "weather"}
    assert echoed["text"]["format"]["schema"] == schema
    client.post("/v1/responses", json={"model": "m", "input": "x",
                                       "text": {"format": {"type": "json_object"}}})
    assert router.requests[-1].response_format == ResponseFormat(type="json_object")


def test_function_calls_as_output_items():
    calls = [("weather", '{"city": "Oslo"}'), ("weather", '{"city": "Bergen"}')]
    _, client = scripted(lambda request: scripted_reply(request, ["Checking."], calls))
    body = client.post("/v1/responses", json={"model": "m", "input": "x",
                                              "tools": [WEATHER]}).json()
    assert [item["type"] for item in body["output"]] == ["message", "function_call",
                                                         "function_call"]
    call = body["output"][1]
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == \
        ("call_0", "weather", '{"city": "Oslo"}', "completed")
    single = client.post("/v1/responses", json={"model": "m", "input": "x", "tools": [WEATHER],
                                                "parallel_tool_calls": False}).json()
    assert [item["type"] for item in single["output"]] == ["message", "function_call"]
    with client.stream("POST", "/v1/responses", json={"model": "m", "input": "x",
                                                      "stream": True}) as response:
        events = sse(response.iter_lines())
    function_call_events = ["response.output_item.added",
                            "response.function_call_arguments.delta",
                            "response.function_call_arguments.done",
                            "response.output_item.done"]
    assert [e["type"] for e in events] == [
        *STREAM_OPENING, "response.output_text.delta", *STREAM_CLOSING,
        *function_call_events, *function_call_events, "response.completed"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] \
        == [0, 1, 2]
    assert events[-1]["response"]["output"][2]["arguments"] == '{"city": "Bergen"}'


def test_official_client_reads_function_calls():
    calls = [("weather", '{"city": "Oslo"}')]
    _, client = scripted(lambda request: scripted_reply(request, [], calls))
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    with sdk.responses.stream(model="m", input="x", tools=[WEATHER]) as stream:
        final = stream.get_final_response()
    [call] = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Oslo"}


def crash_midway(request):
    from shoal.protocol import ErrorChunk

    return scripted_reply(request, ["partial"])[:2] + [ErrorChunk(
        request_id=request.request_id, code="runner_crashed", message="the runner died")]


def test_error_mid_stream_fails_the_response():
    _, client = scripted(crash_midway)
    with client.stream("POST", "/v1/responses", json={"model": "m", "input": "x",
                                                      "stream": True}) as response:
        events = sse(response.iter_lines())
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"] == {"code": "server_error",
                                               "message": "the runner died"}
    whole = client.post("/v1/responses", json={"model": "m", "input": "x"})
    assert whole.status_code == 503 and whole.json()["error"]["message"] == "the runner died"
