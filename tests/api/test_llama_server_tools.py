"""A tool call through llama-server: Qwen2.5-Coder-0.5B (its GGUF chat template takes
tools) served by llama-server as a shoal runner; llama-server renders the tools, parses the
call out of the reply, and shoal hands it back in each dialect's shape (OpenAI tool_calls,
whole and streamed; Ollama message.tool_calls; Anthropic tool_use). One node, one slot so
the prompt cache serves every request after the first (slow).

The assistant turn is started with Qwen's tool-call tag: this 0.5B model, asked plainly,
writes the call's JSON without the <tool_call> tags its template asks for, which
llama-server (rightly) reads as prose. The prefill is an ordinary trailing assistant
message in each dialect; what comes back is llama-server's own parse of the reply."""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import openai
import pytest

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

pytestmark = pytest.mark.slow

MODEL_ID = "qwen2.5-coder-0.5b-instruct"
CITY = {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string", "enum": ["Paris", "London"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": CITY}}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
# The start of Qwen's tool-call block (see the module's docstring).
CALL_STARTED = {"role": "assistant", "content": '<tool_call>\n{"name": "'}


@pytest.fixture(scope="module")
def node(tmp_path_factory, llama_server_binary):
    tmp = tmp_path_factory.mktemp("llama-server-tools")
    config = NodeConfig(
        server=ServerConfig(port=0), models=(MODEL_ID,), data_dir=tmp,
        cluster=ClusterSettings(standalone=True),
        engine=EngineDefaults(max_model_len=1024, threads=2),
        pool=PoolSettings(queue=QueueLimits(parallel=1)),
        backends=BackendSettings(llama_server=llama_server_binary,
                                 assigned=((MODEL_ID, "llama-server"),)))
    background = BackgroundNode(config, start_timeout_s=300)
    background.start()
    yield background.url
    background.stop()


def test_openai_chat_gets_llama_servers_tool_call_whole_and_streamed(node):
    client = openai.OpenAI(base_url=node + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    request = {"model": MODEL_ID, "messages": [QUESTION, CALL_STARTED], "tools": [WEATHER],
               "max_tokens": 24, "temperature": 0}
    whole = client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert whole.usage.completion_tokens > 0

    chunks = list(client.chat.completions.create(**request, stream=True))
    parts = [part for chunk in chunks if chunk.choices
             for part in chunk.choices[0].delta.tool_calls or ()]
    assert parts and parts[0].function.name == "get_weather"
    arguments = "".join(part.function.arguments or "" for part in parts)
    assert json.loads(arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_ollama_and_anthropic_get_the_same_call_in_their_shapes(node):
    reply = ollama.Client(host=node, timeout=120).chat(
        model=MODEL_ID, messages=[QUESTION, CALL_STARTED], tools=[WEATHER],
        options={"temperature": 0, "num_predict": 24})
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather"
    assert dict(call.function.arguments) == {"city": "Paris"}

    claude = anthropic.Anthropic(base_url=node, api_key="unused", max_retries=0, timeout=120)
    message = claude.messages.create(
        model=MODEL_ID, max_tokens=24, messages=[QUESTION, CALL_STARTED],
        tools=[{"name": "get_weather", "description": "The weather in a city",
                "input_schema": CITY}], extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use"
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}


def test_a_tool_result_goes_back_to_llama_server(node):
    """The call and its result, as the client sends them back, reach llama-server's
    template (a malformed history would be its 400 or 500, not an answer)."""
    answered = httpx.post(node + "/v1/chat/completions", timeout=120, json={
        "model": MODEL_ID, "temperature": 0, "max_tokens": 8, "tools": [WEATHER],
        "messages": [QUESTION,
                     {"role": "assistant", "content": None, "tool_calls": [{
                         "id": "call_0", "type": "function", "function": {
                             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 24 C"}]})
    assert answered.status_code == 200, answered.text
    message = answered.json()["choices"][0]["message"]
    assert message["content"] and not message.get("tool_calls")
