"""The OpenAI HTTP API over a real node thread serving the fake engine."""

from __future__ import annotations

import json
import time

import httpx
import pytest


def post(node, path, body, **kwargs):
    return httpx.post(node.url + path, json=body, timeout=20, **kwargs)


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi there"}]}


def test_chat_non_streaming(fake_node):
    response = post(fake_node, "/v1/chat/completions", CHAT)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "fake-model"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant",
                                 "content": "".join(f"w{i} " for i in range(1, 9))}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    usage = body["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8


def test_chat_streaming_with_usage_and_logprobs(fake_node):
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "model": "fake"}
    with httpx.stream("POST", fake_node.url + "/v1/chat/completions", json=body,
                      timeout=20) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "w1 w2 w3 "
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    logprobs = chunks[1]["choices"][0]["logprobs"]["content"][0]
    assert logprobs["token"] == "w1 " and len(logprobs["top_logprobs"]) == 2


def test_completions_both_ways(fake_node):
    body = {"model": "fake-model", "prompt": "once upon", "max_tokens": 4, "logprobs": 1,
            "stop": ["w3"]}
    response = post(fake_node, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == "w1 w2 " and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"][:2] == ["w1 ", "w2 "]
    assert choice["logprobs"]["text_offset"][:2] == [0, 3]
    with httpx.stream("POST", fake_node.url + "/v1/completions",
                      json={**body, "stream": True, "logprobs": None}, timeout=20) as response:
        events = sse_events(response)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "w1 w2 "
    assert events[-1] == "[DONE]"


def test_completions_default_max_tokens_and_token_prompt(fake_node):
    response = post(fake_node, "/v1/completions", {"model": "fake-model", "prompt": [5, 6, 7]})
    assert response.json()["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("body,param", [
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "temperature": 5000}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({**CHAT, "logit_bias": {"999999": 1}}, "logit_bias"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({"model": "fake-model"}, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({**CHAT, "stop": ""}, "stop"),
])
def test_invalid_parameters_are_400_naming_the_parameter(fake_node, body, param):
    response = post(fake_node, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error" and error["message"]


def test_error_mappings(fake_node):
    unknown = post(fake_node, "/v1/chat/completions", {**CHAT, "model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    long = post(fake_node, "/v1/completions", {"model": "fake-model", "prompt": "x " * 300})
    assert long.status_code == 400
    assert long.json()["error"]["code"] == "context_length_exceeded"
    broken = post(fake_node, "/v1/completions", {"model": "broken-model", "prompt": "x"})
    assert broken.status_code == 503 and "not supported" in broken.json()["error"]["message"]
    bad_json = httpx.post(fake_node.url + "/v1/completions", content=b"{nope",
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    missing = httpx.get(fake_node.url + "/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


def test_engine_failure_mid_request_is_an_error_not_a_hang(fake_node):
    response = post(fake_node, "/v1/completions", {"model": "fake-model", "prompt": "RAISE"})
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal"


def test_overload_is_429(fake_node):
    streams = []
    with httpx.Client(timeout=20) as client:
        for _ in range(4):
            request = client.build_request("POST", fake_node.url + "/v1/completions",
                                           json={"model": "fake-model", "prompt": "FOREVER SLOW",
                                                 "stream": True, "max_tokens": 100})
            response = client.send(request, stream=True)
            assert response.status_code == 200
            streams.append(response)
        refused = client.post(fake_node.url + "/v1/completions",
                              json={"model": "fake-model", "prompt": "x"})
        for response in streams:
            response.close()
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"


def _aborted_ids(node) -> set[str]:
    return set(node.abort_log.read_text().split()) if node.abort_log.exists() else set()


def _wait_until(predicate, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _settled_aborts(node) -> set[str]:
    """The aborted ids once no new abort arrived for half a second."""
    previous = _aborted_ids(node)
    while True:
        time.sleep(0.5)
        current = _aborted_ids(node)
        if current == previous:
            return current
        previous = current


def test_client_disconnect_cancels_streaming_and_non_streaming(fake_node):
    body = {"model": "fake-model", "prompt": "FOREVER SLOW", "max_tokens": 100}
    with httpx.stream("POST", fake_node.url + "/v1/completions", json={**body, "stream": True},
                      timeout=20) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                request_id = json.loads(line[len("data: "):])["id"]
                break  # one token, then hang up
    assert _wait_until(lambda: request_id in _aborted_ids(fake_node))
    before = _settled_aborts(fake_node)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fake_node.url + "/v1/completions", json=body, timeout=1.0)
    assert _wait_until(lambda: len(_aborted_ids(fake_node) - before) == 1), (before, _aborted_ids(fake_node))


def test_models_and_health(fake_node):
    models = httpx.get(fake_node.url + "/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "fake-model" and models["data"][0]["owned_by"] == "shoal"
    health = httpx.get(fake_node.url + "/health")
    assert health.json()["models"][0]["model"] == "fake-model"


def test_health_counts_streams_in_flight(fake_node):
    body = {"model": "fake-model", "prompt": "FOREVER SLOW", "max_tokens": 50, "stream": True}
    with httpx.stream("POST", fake_node.url + "/v1/completions", json=body,
                      timeout=20) as response:
        lines = response.iter_lines()  # held: a dropped iterator closes the connection
        for line in lines:
            if line.startswith("data: "):
                break
        assert httpx.get(fake_node.url + "/health").json()["models"][0]["in_flight"] == 1
