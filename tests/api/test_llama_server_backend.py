"""SmolLM2 served by llama-server as a shoal runner (the binary tests/llama_server_build.py
builds): the three dialects, streaming, JSON output, refusals (tools SmolLM2's template
cannot take among them), cancel, a crash, and greedy output equal to llama-server's own.
One node for the module (slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import anthropic
import httpx
import ollama
import openai
import psutil
import pytest

from shoal.catalog.resolve import resolve_model
from shoal.config import (
    BackendSettings,
    ClusterSettings,
    EngineDefaults,
    NodeConfig,
    PoolSettings,
    ServerConfig,
)
from shoal.node import BackgroundNode
from shoal.pool.queue import QueueLimits
from shoal.runner.llama_server.launch import LaunchSettings, free_port, launch_command

pytestmark = pytest.mark.slow

MODEL_ID = "smollm2-135m-instruct"
CONTEXT = 2048
QUESTION = [{"role": "user", "content": "Name three colours."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "London"]}}}}}


def llama_servers() -> list[psutil.Process]:
    """The llama-server processes this test process started (through its node or itself)."""
    return [p for p in psutil.Process().children(recursive=True)
            if p.name() == "llama-server"]


@pytest.fixture(scope="module")
def node(tmp_path_factory, llama_server_binary):
    tmp = tmp_path_factory.mktemp("llama-server-node")
    config = NodeConfig(
        server=ServerConfig(port=0, keepalive_s=0.3), models=(MODEL_ID,), data_dir=tmp,
        cluster=ClusterSettings(standalone=True),
        engine=EngineDefaults(max_model_len=CONTEXT, threads=2),
        pool=PoolSettings(queue=QueueLimits(parallel=4)),
        backends=BackendSettings(llama_server=llama_server_binary,
                                 assigned=(("smollm2", "llama-server"),)))
    background = BackgroundNode(config, start_timeout_s=300)
    background.start()
    yield background.url
    background.stop()


@pytest.fixture(scope="module")
def direct(node, llama_server_binary):
    """The same llama-server binary and model, started by hand: what shoal must match."""
    path = resolve_model(MODEL_ID).path
    port = free_port()
    settings = LaunchSettings(binary=llama_server_binary, slots=4, context=CONTEXT, threads=2)
    process = subprocess.Popen(launch_command(settings, MODEL_ID, path, port),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    yield url
    process.terminate()
    process.wait(10)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=180)


def test_the_node_says_llama_server_serves_the_model(node):  # before any other model loads
    health = httpx.get(node + "/health").json()
    (served,) = health["models"]
    assert served["model"] == MODEL_ID and served["backend"] == "llama-server"
    assert served["state"] == "ready" and served["size_bytes"] > 10 * 2**20  # its RSS
    assert served["pid"] in [p.pid for p in llama_servers()]
    (instance,) = httpx.get(node + "/cluster").json()["instances"]
    assert instance["backend"] == "llama-server"
    node_info = httpx.get(node + "/cluster").json()["nodes"][0]
    assert node_info["backends"] == ["engine", "llama-server"]
    assert node_info["backend_devices"]["llama-server"] == ["cpu"]
    ps = httpx.get(node + "/api/ps").json()["models"]
    assert [m["model"] for m in ps] == [MODEL_ID] and ps[0]["size"] > 0
    metrics = httpx.get(node + "/metrics").text
    resident = 'shoal_runner_resident_bytes{backend="llama-server",model="%s"}' % MODEL_ID
    assert resident in metrics


def test_greedy_output_equals_llama_servers_own(node, direct):
    prompt = {"prompt": "The sea is", "temperature": 0, "max_tokens": 16}
    ours = post(node, "/v1/completions", {"model": "smollm2", **prompt}).json()
    theirs = post(direct, "/completion", {"prompt": "The sea is", "temperature": 0,
                                          "n_predict": 16}).json()
    assert ours["choices"][0]["text"] == theirs["content"]
    assert ours["usage"]["completion_tokens"] == theirs["tokens_predicted"]
    chat = {"messages": QUESTION, "temperature": 0, "max_tokens": 16}
    ours = post(node, "/v1/chat/completions", {"model": "smollm2", **chat}).json()
    theirs = post(direct, "/v1/chat/completions", chat).json()
    assert ours["choices"][0]["message"]["content"] == \
        theirs["choices"][0]["message"]["content"]
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]


def test_openai_chat_streams_the_same_text(node):
    client = openai.OpenAI(base_url=node + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    request = {"model": "smollm2", "messages": QUESTION, "max_tokens": 12, "temperature": 0}
    whole = client.chat.completions.create(**request)
    stream = client.chat.completions.create(**request, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    reply = client.responses.create(model="smollm2", input="Name three colours.",
                                    max_output_tokens=12, temperature=0)
    assert reply.output_text == text


def test_ollama_and_anthropic_clients(node):
    client = ollama.Client(host=node, timeout=60)
    options = {"temperature": 0, "num_predict": 12}
    reply = client.chat(model="smollm2", messages=QUESTION, options=options)
    assert reply.message.content and reply.model == MODEL_ID and 0 < reply.eval_count <= 12
    streamed = "".join(part.message.content for part in
                       client.chat(model="smollm2", messages=QUESTION, options=options,
                                   stream=True))
    assert streamed == reply.message.content
    generated = client.generate(model="smollm2", prompt="The sky is", options=options,
                                raw=True)
    assert generated.response and generated.prompt_eval_count == 3
    claude = anthropic.Anthropic(base_url=node, api_key="unused", max_retries=0, timeout=60)
    request = {"model": "smollm2", "max_tokens": 12, "messages": QUESTION,
               "extra_body": {"temperature": 0}}
    message = claude.messages.create(**request)
    assert message.content[0].text == reply.message.content
    with claude.messages.stream(**request) as stream:
        assert "".join(stream.text_stream) == message.content[0].text
    counted = claude.messages.count_tokens(model="smollm2", messages=QUESTION)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_tools_the_template_cannot_take_are_refused_and_json_output_is_honoured(node):
    asked = {"model": "smollm2", "temperature": 0, "max_tokens": 64, "tools": [WEATHER],
             "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
             "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    # SmolLM2's template takes no tools (llama-server's /props says so): llama-server would
    # drop them and answer in prose, so shoal refuses in each dialect.
    refused = post(node, "/v1/chat/completions", asked)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    assert "chat template does not take tools" in refused.json()["error"]["message"]
    claude = post(node, "/v1/messages", {
        "model": "smollm2", "max_tokens": 16, "messages": asked["messages"],
        "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]})
    assert claude.status_code == 400 and claude.json()["type"] == "error"
    schema = {"type": "object", "required": ["colour"], "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue"]}}}
    answer = post(node, "/v1/chat/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 48, "messages": QUESTION,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "c", "schema": schema}}}).json()
    assert json.loads(answer["choices"][0]["message"]["content"])["colour"] in \
        ("red", "green", "blue")


def test_what_llama_server_cannot_do_is_a_400_in_each_dialect(node):
    refused = post(node, "/v1/chat/completions", {"model": "smollm2", "messages": QUESTION,
                                                  "logprobs": True, "max_tokens": 4})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "logprobs"
    assert "llama-server" in refused.json()["error"]["message"]
    ollama_refused = post(node, "/api/generate", {"model": "smollm2", "prompt": "x",
                                                  "stream": False, "logprobs": True})
    assert ollama_refused.status_code == 400 and "llama-server" in ollama_refused.text
    embedded = post(node, "/v1/embeddings", {"model": "smollm2", "input": "x"})
    assert embedded.status_code == 400
    placed = post(node, "/instances", {"model": "smollm2", "backend": "diffusers"})
    assert placed.status_code == 400 and placed.json()["error"]["param"] == "backend"


def test_closing_the_stream_or_cancelling_frees_llama_servers_slot(node):
    long = {"model": "smollm2", "prompt": "Count:", "max_tokens": 1500, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", node + "/v1/completions", json=long, timeout=60) as response:
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        assert httpx.post(f"{node}/v1/requests/{request_id}/cancel").status_code == 200
        rest = [line for line in lines if line.startswith("data:")]
    assert len(rest) < 1500 and rest[-1] == "data: [DONE]"
    assert '"finish_reason":"abort"' in "".join(rest).replace(" ", "")
    with httpx.stream("POST", node + "/v1/completions", json=long, timeout=60) as response:
        next(line for line in response.iter_lines() if line.startswith("data:"))
    # llama-server notices the closed HTTP stream and stops decoding for it.
    (served,) = [p for p in llama_servers()
                 if p.pid == httpx.get(node + "/health").json()["models"][0]["pid"]]
    port = served.cmdline()[served.cmdline().index("--port") + 1]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        slots = httpx.get(f"http://127.0.0.1:{port}/slots").json()
        if not any(slot["is_processing"] for slot in slots):
            break
        time.sleep(0.1)
    assert not any(slot["is_processing"] for slot in slots)


def test_a_killed_llama_server_fails_its_requests_at_once_then_serves_again(node):
    pid = httpx.get(node + "/health").json()["models"][0]["pid"]
    long = {"model": "smollm2", "prompt": "Count:", "max_tokens": 1500, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", node + "/v1/completions", json=long, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        rest = list(lines)
        ended = time.monotonic()
    assert ended - killed < 2.0
    assert any("error" in line for line in rest)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        served = post(node, "/v1/completions", {"model": "smollm2", "prompt": "The sea is",
                                                "max_tokens": 4, "temperature": 0})
        if served.status_code == 200:
            break
        time.sleep(0.2)
    assert served.status_code == 200 and served.json()["choices"][0]["text"]
    model = httpx.get(node + "/health").json()["models"][0]
    assert model["restarts"] == 1 and model["pid"] != pid
