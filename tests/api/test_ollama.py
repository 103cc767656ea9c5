"""The Ollama HTTP API: a real node thread serving the fake engine, the official `ollama`
client against it, and an in-process scripted router for field mapping and tool calls."""

from __future__ import annotations

import json
import time

import httpx
import ollama
import pytest
from fakes import ScriptedRouter, scripted_reply
from fastapi.testclient import TestClient

from shoal.api.app import create_app
from shoal.api.errors import APIError
from shoal.api.ollama.options import keep_alive_seconds
from shoal.protocol import ResponseFormat, ToolSpec

EIGHT_WORDS = "".join(f"w{i} " for i in range(1, 9))
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi there"}]}


def post(node, path, body):
    return httpx.post(node.url + path, json=body, timeout=20)


def ndjson(response) -> list[dict]:
    return [json.loads(line) for line in response.iter_lines() if line]


# ---- chat and generate over the fake engine -------------------------------------------------

def test_chat_non_streaming_shape(fake_node):
    response = post(fake_node, "/api/chat", {**CHAT, "stream": False})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "fake-model" and body["created_at"].endswith("Z")
    assert body["message"] == {"role": "assistant", "content": EIGHT_WORDS}
    assert body["done"] is True and body["done_reason"] == "stop"
    assert body["eval_count"] == 8 and body["prompt_eval_count"] > 0
    for name in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(body[name], int) and body[name] >= 0
    assert body["total_duration"] >= body["eval_duration"]


def test_chat_streams_ndjson_by_default(fake_node):
    with httpx.stream("POST", fake_node.url + "/api/chat", json=CHAT, timeout=20) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = ndjson(response)
    assert all(line["done"] is False for line in lines[:-1])
    assert "".join(line["message"]["content"] for line in lines) == EIGHT_WORDS
    final = lines[-1]
    assert final["done"] is True and final["done_reason"] == "stop" and final["eval_count"] == 8


def test_generate_options_and_raw(fake_node):
    body = {"model": "fake", "prompt": "one two three", "stream": False,
            "options": {"num_predict": 3, "temperature": 0, "seed": -1, "num_ctx": 4096,
                        "typical_p": 1.0, "some_future_option": 7}}
    templated = post(fake_node, "/api/generate", body).json()
    assert templated["response"] == "w1 w2 w3 " and templated["done_reason"] == "length"
    raw = post(fake_node, "/api/generate", {**body, "raw": True}).json()
    # The fake tokenizer counts words: raw sees the prompt alone, templated the chat turn too.
    assert raw["prompt_eval_count"] == 3 < templated["prompt_eval_count"]
    stopped = post(fake_node, "/api/generate", {**body, "options": {"stop": ["w3"]}}).json()
    assert stopped["response"] == "w1 w2 " and stopped["done_reason"] == "stop"


def test_generate_logprobs(fake_node):
    body = {"model": "fake-model", "prompt": "hi", "stream": False, "logprobs": True,
            "top_logprobs": 2, "options": {"num_predict": 2}}
    logprobs = post(fake_node, "/api/generate", body).json()["logprobs"]
    assert [item["token"] for item in logprobs] == ["w1 ", "w2 "]
    assert len(logprobs[0]["top_logprobs"]) == 2


@pytest.mark.parametrize("body,needle", [
    ({**CHAT, "options": {"temperature": "hot"}}, "options.temperature"),
    ({**CHAT, "options": {"temperature": 500}}, "options.temperature"),
    ({**CHAT, "options": {"num_predict": 0}}, "options.num_predict"),
    ({**CHAT, "options": {"mirostat": 2}}, "options.mirostat"),
    ({**CHAT, "options": {"top_p": 0}}, "options.top_p"),
    ({**CHAT, "keep_alive": "five minutes"}, "keep_alive"),
    ({**CHAT, "format": "xml"}, "format"),
    ({**CHAT, "think": True}, "think: model 'fake-model' does not support reasoning"),
    ({**CHAT, "think": "max"}, "think"),
    ({**CHAT, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
     "messages.0.images.0: the image is not a PNG"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": CHAT["messages"]}, "model"),
    ({**CHAT, "tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools.0.type"),
])
def test_bad_input_is_400_naming_the_field(fake_node, body, needle):
    response = post(fake_node, "/api/chat", body)
    assert response.status_code == 400, response.text
    assert list(response.json()) == ["error"] and needle in response.json()["error"]


def test_error_statuses(fake_node):
    unknown = post(fake_node, "/api/chat", {**CHAT, "model": "nope"})
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]
    long = post(fake_node, "/api/generate", {"model": "fake-model", "prompt": "x " * 300,
                                             "raw": True})
    assert long.status_code == 400 and "context" in long.json()["error"]
    broken = post(fake_node, "/api/generate", {"model": "broken-model", "prompt": "x"})
    assert broken.status_code == 503 and "error" in broken.json()
    bad_json = httpx.post(fake_node.url + "/api/chat", content=b"{nope",
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]
    missing = httpx.get(fake_node.url + "/api/nothing")
    assert missing.status_code == 404 and list(missing.json()) == ["error"]


def _running_models(node) -> list[str]:
    return [m["model"] for m in httpx.get(node.url + "/api/ps").json()["models"]]


def test_empty_prompt_unloads_and_loads(fake_node):
    unloaded = post(fake_node, "/api/chat", {"model": "fake-model", "messages": [],
                                             "keep_alive": 0, "stream": False})
    assert unloaded.json()["done_reason"] == "unload"
    assert unloaded.json()["message"] == {"role": "assistant", "content": ""}
    deadline = time.monotonic() + 10
    while "fake-model" in _running_models(fake_node) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "fake-model" not in _running_models(fake_node)
    loaded = post(fake_node, "/api/generate", {"model": "fake-model", "stream": False,
                                               "keep_alive": -1})
    assert loaded.json()["done_reason"] == "load" and loaded.json()["response"] == ""
    assert "fake-model" in _running_models(fake_node)
    unknown = post(fake_node, "/api/generate", {"model": "nope"})
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]


# ---- model endpoints ------------------------------------------------------------------------

def test_tags_list_what_v1_models_lists(fake_node):
    tags = httpx.get(fake_node.url + "/api/tags").json()["models"]
    openai_ids = [m["id"] for m in httpx.get(fake_node.url + "/v1/models").json()["data"]]
    assert [m["name"] for m in tags] == openai_ids and "fake-model" in openai_ids
    fake = next(m for m in tags if m["name"] == "fake-model")
    assert fake["size"] == (fake_node.config.data_dir / "fake-model.gguf").stat().st_size
    assert len(fake["digest"]) == 64
    assert fake["details"]["format"] == "gguf"


def test_ps_show_version_and_liveness(fake_node):
    running = httpx.get(fake_node.url + "/api/ps").json()["models"]
    assert [m["model"] for m in running] == ["fake-model"]  # a model that failed is not running
    assert running[0]["context_length"] == 128
    # The fake engine cannot tell its weights or KV cache: "size" is what its runner holds,
    # its RSS.
    held = running[0]["shoal"]
    assert running[0]["size"] == held["rss_bytes"] > 0 and running[0]["size_vram"] == 0
    assert held["weights_bytes"] is None and held["kv_bytes_in_use"] is None
    shown = post(fake_node, "/api/show", {"model": "fake-model:latest"})
    assert shown.status_code == 200 and shown.json()["capabilities"] == ["completion", "tools"]
    assert shown.json()["model_info"]["unknown.context_length"] == 128
    assert post(fake_node, "/api/show", {"name": "nope"}).status_code == 404
    assert httpx.get(fake_node.url + "/api/version").json()["version"]
    assert httpx.get(fake_node.url + "/").text == "Ollama is running"
    assert httpx.head(fake_node.url + "/").status_code == 200


def test_pull_resolves_locally_or_says_why_not(fake_node):
    with httpx.stream("POST", fake_node.url + "/api/pull", json={"model": "smollm2"},
                      timeout=60) as response:
        lines = ndjson(response)
    assert lines[0] == {"status": "pulling manifest"} and lines[-1] == {"status": "success"}
    assert lines[1]["total"] == lines[1]["completed"] > 1_000_000
    quiet = post(fake_node, "/api/pull", {"name": "smollm2", "stream": False})
    assert quiet.json() == {"status": "success"}
    # Tests send pulls to a closed port (tests/conftest.py): a clear 502 naming the source.
    unreachable = post(fake_node, "/api/pull", {"model": "no-such-model"})
    assert unreachable.status_code == 502
    assert unreachable.json()["error"].startswith(
        "pull 'no-such-model:latest' from Ollama's registry (http://127.0.0.1:")
    bad = post(fake_node, "/api/pull", {"model": "a/b/c:d"})
    assert bad.status_code == 400 and "not a model name shoal can pull" in bad.json()["error"]
    missing = httpx.request("DELETE", fake_node.url + "/api/delete",
                            json={"model": "no-such-model"})
    assert missing.status_code == 404 and "not in the model store" in missing.json()["error"]


# ---- the official client --------------------------------------------------------------------

def test_official_client(fake_node):
    client = ollama.Client(host=fake_node.url)
    reply = client.chat(model="fake-model", messages=CHAT["messages"], options={"num_predict": 2})
    assert reply.message.content == "w1 w2 " and reply.done_reason == "length"
    pieces = [part.response for part in client.generate(model="fake", prompt="hi", stream=True)]
    assert "".join(pieces) == EIGHT_WORDS
    assert "fake-model" in [m.model for m in client.list().models]
    assert client.ps().models[0].context_length == 128
    assert client.show("fake-model").capabilities == ["completion", "tools"]
    with pytest.raises(ollama.ResponseError) as error:
        client.chat(model="nope", messages=CHAT["messages"])
    assert error.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as error:
        client.chat(model="fake-model", messages=CHAT["messages"], options={"top_k": -1})
    assert error.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match="fake engine step failure"):
        for _ in client.generate(model="fake-model", prompt="RAISE", stream=True):
            pass  # the engine fails after the stream began: an {"error"} line ends it


# ---- field mapping and tool calls (scripted router, in-process) ----------------------------

def scripted(script=None):
    router = ScriptedRouter(script)
    return router, TestClient(create_app(router, list_available=list))


def test_fields_map_to_the_internal_request():
    router, client = scripted()
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "weather", "description": "Weather now",
                                             "parameters": schema}}
    history = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "-3C", "tool_name": "weather"},
    ]
    response = client.post("/api/chat", json={
        "model": "m:latest", "messages": history, "tools": [tool], "format": "json",
        "keep_alive": "1h30m", "stream": False,
        "options": {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3, "num_predict": 9,
                    "stop": ["END"], "repeat_penalty": 1.2, "min_p": 0.1}})
    assert response.status_code == 200, response.text
    internal = router.requests[-1]
    assert internal.model == "m" and internal.keep_alive_s == 5400.0
    assert internal.response_format == ResponseFormat(type="json_object")
    assert internal.tools == (ToolSpec(name="weather", description="Weather now",
                                       parameters=schema),)
    s = internal.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens, s.stop) == \
        (0.5, 0.9, 7, 3, 9, ("END",))
    assert (s.repetition_penalty, s.min_p) == (1.2, 0.1)
    call = internal.messages[2].tool_calls[0]
    assert call.name == "weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert internal.messages[3].role == "tool" and internal.messages[3].name == "weather"
    client.post("/api/generate", json={"model": "m", "prompt": "x", "format": schema,
                                       "keep_alive": -1, "stream": False})
    assert router.requests[-1].response_format == ResponseFormat(type="json_schema",
                                                                 json_schema=schema)
    assert router.requests[-1].keep_alive_s == -1.0


@pytest.mark.parametrize("raw,seconds", [
    (None, None), (0, 0.0), ("0", 0.0), (300, 300.0), ("300", 300.0), (2.5, 2.5),
    ("5m", 300.0), ("1h30m", 5400.0), ("10ms", 0.01), ("1.5h", 5400.0), (-1, -1.0),
    ("-1m", -1.0), ("-5", -1.0),
])
def test_keep_alive_durations(raw, seconds):
    assert keep_alive_seconds(raw) == seconds


@pytest.mark.parametrize("raw", ["", "5 minutes", "m", "5x", True, float("nan"), "1h-30m"])
def test_bad_keep_alive(raw):
    with pytest.raises(APIError) as error:
        keep_alive_seconds(raw)
    assert error.value.status == 400 and error.value.param == "keep_alive"


def test_tool_calls_render_as_message_tool_calls():
    calls = [("weather", '{"city": "Oslo"}'), ("time", "{}")]
    _, client = scripted(lambda request: scripted_reply(request, ["Checking."], calls))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    message = client.post("/api/chat", json=body).json()["message"]
    assert message["content"] == "Checking."
    assert [c["function"] for c in message["tool_calls"]] == [
        {"index": 0, "name": "weather", "arguments": {"city": "Oslo"}},
        {"index": 1, "name": "time", "arguments": {}}]
    with client.stream("POST", "/api/chat", json={**body, "stream": True}) as response:
        lines = ndjson(response)
    streamed = [c for line in lines for c in line["message"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in streamed] == ["weather", "time"]
    assert lines[-1]["done"] is True and lines[-1]["done_reason"] == "stop"
    parsed = ollama.ChatResponse(**client.post("/api/chat", json=body).json())
    assert parsed.message.tool_calls[0].function.arguments == {"city": "Oslo"}


def crash_midway(request):
    from shoal.protocol import ErrorChunk

    return scripted_reply(request, ["partial"])[:2] + [ErrorChunk(
        request_id=request.request_id, code="runner_crashed", message="the runner died")]


def test_error_mid_stream_is_an_error_line():
    _, client = scripted(crash_midway)
    with client.stream("POST", "/api/generate", json={"model": "m", "prompt": "x"}) as response:
        lines = ndjson(response)
    assert lines[0]["response"] == "partial" and lines[-1] == {"error": "the runner died"}
    whole = client.post("/api/generate", json={"model": "m", "prompt": "x", "stream": False})
    assert whole.status_code == 503 and whole.json() == {"error": "the runner died"}


@pytest.mark.parametrize("endpoint,response_type,field", [
    ("chat", ollama.ChatResponse, "message"), ("generate", ollama.GenerateResponse, "response")])
def test_keepalive_line_is_an_empty_piece_clients_parse(endpoint, response_type, field):
    from shoal.api.ollama.adapter import OllamaResponder

    line = OllamaResponder(endpoint=endpoint, model="m").keepalive_event()
    assert line.endswith("\n") and "\n" not in line[:-1]  # one NDJSON line, no comment syntax
    parsed = response_type(**json.loads(line))
    assert parsed.done is False
    assert (parsed.message.content if field == "message" else parsed.response) == ""
