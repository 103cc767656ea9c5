"""The Ollama, Anthropic and OpenAI Responses dialects of a real `shoal serve` subprocess
with SmolLM2, driven by the official clients (slow)."""

from __future__ import annotations

import anthropic
import httpx
import ollama
import openai
import pytest
from test_real_server import server  # noqa: F401 - the module-scoped `shoal serve` fixture

pytestmark = pytest.mark.slow

MODEL_ID = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "Name three colours."}]


def test_ollama_client(server):  # noqa: F811
    client = ollama.Client(host=server, timeout=60)
    options = {"temperature": 0, "num_predict": 12}
    reply = client.chat(model="smollm2", messages=QUESTION, options=options)
    assert reply.message.content and reply.done_reason in ("stop", "length")
    assert reply.model == MODEL_ID and 0 < reply.eval_count <= 12
    streamed = "".join(part.message.content for part in
                       client.chat(model="smollm2:latest", messages=QUESTION, options=options,
                                   stream=True))
    assert streamed == reply.message.content  # greedy: the same answer either way
    generated = client.generate(model="smollm2", prompt="The sky is", options=options, raw=True)
    assert generated.response and generated.prompt_eval_count == 3
    listed = [m.model for m in client.list().models]
    openai_ids = [m["id"] for m in httpx.get(server + "/v1/models").json()["data"]]
    assert listed == openai_ids and MODEL_ID in listed
    assert MODEL_ID in [m.model for m in client.ps().models]
    shown = client.show("smollm2")
    assert shown.details.family == "llama" and shown.details.quantization_level == "Q4_1"
    with pytest.raises(ollama.ResponseError) as error:
        client.chat(model="no-such-model", messages=QUESTION)
    assert error.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as error:
        client.generate(model="smollm2", prompt="x", options={"top_p": 7})
    assert error.value.status_code == 400


def test_anthropic_client(server):  # noqa: F811
    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=60)
    request = {"model": "smollm2", "max_tokens": 12, "messages": QUESTION,
               "extra_body": {"temperature": 0}}
    message = client.messages.create(**request)
    text = message.content[0].text
    assert text and message.stop_reason in ("end_turn", "max_tokens")
    assert message.model == MODEL_ID and 0 < message.usage.output_tokens <= 12
    with client.messages.stream(**request) as stream:
        assert "".join(stream.text_stream) == text
    counted = client.messages.count_tokens(model="smollm2", messages=QUESTION)
    usage = message.usage  # prompt tokens the prefix cache served are counted apart
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    chat = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "messages": QUESTION, "max_tokens": 1}).json()
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]  # one chat template
    short, longer = (client.messages.count_tokens(model="smollm2", system=system,
                                                  messages=QUESTION).input_tokens
                     for system in ("Answer in French.", "Answer in French, and briefly."))
    assert longer > short
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**{**request, "model": "no-such-model"})
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(**{**request, "extra_body": {"temperature": 3}})


def test_openai_responses_client(server):  # noqa: F811
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    request = {"model": "smollm2", "input": "Name three colours.", "max_output_tokens": 12,
               "temperature": 0}
    reply = client.responses.create(**request)
    assert reply.output_text and reply.status in ("completed", "incomplete")
    assert reply.model == MODEL_ID and 0 < reply.usage.output_tokens <= 12
    with client.responses.stream(**request) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == reply.output_text
    assert events[-1].type == f"response.{reply.status}"  # incomplete when cut at 12 tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.create(**{**request, "model": "no-such-model"})
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**{**request, "top_p": 7})


CITY = {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30},
                       "country": {"type": "string", "maxLength": 30}},
        "required": ["city", "country"]}
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather in a city",
                "input_schema": {"type": "object",
                                 "properties": {"city": {"type": "string", "maxLength": 30}},
                                 "required": ["city"]}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]
GREEDY = {"temperature": 0}  # sent as it is: this client's typed signature has no temperature


def test_ollama_client_structured_tools_embeddings_and_pull(server):  # noqa: F811
    import json

    import jsonschema

    client = ollama.Client(host=server, timeout=120)
    reply = client.chat(model="smollm2", messages=[{"role": "user",
                                                    "content": "Name a city and its country."}],
                        format=CITY, options={"temperature": 0, "num_predict": 60})
    jsonschema.validate(json.loads(reply.message.content), CITY)
    tool = {"type": "function", "function": {"name": WEATHER_TOOL["name"],
                                             "description": WEATHER_TOOL["description"],
                                             "parameters": WEATHER_TOOL["input_schema"]}}
    called = client.chat(model="smollm2", messages=WEATHER_QUESTION, tools=[tool],
                         options={"temperature": 0, "num_predict": 60})
    for call in called.message.tool_calls or ():  # "auto": the model may answer in text
        assert call.function.name == "get_weather"
        jsonschema.validate(call.function.arguments, WEATHER_TOOL["input_schema"])
    embedded = client.embed(model="all-minilm", input=["a shoal of fish", "a school of fish"])
    assert len(embedded.embeddings) == 2 and len(embedded.embeddings[0]) == 384
    statuses = [part.status for part in client.pull("smollm2", stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    with pytest.raises(ollama.ResponseError) as error:  # the tests' registry is unreachable
        client.pull("no-such-model")
    assert error.value.status_code == 502 and "no-such-model" in str(error.value)


def test_anthropic_client_forced_tool_call_parses(server):  # noqa: F811
    import jsonschema

    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)
    # Greedy: what is tested is the client reading a forced call, not what sampling picks.
    message = client.messages.create(
        model="smollm2", max_tokens=60, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert message.stop_reason == "tool_use", message
    [block] = [b for b in message.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.id
    jsonschema.validate(block.input, WEATHER_TOOL["input_schema"])
    with client.messages.stream(model="smollm2", max_tokens=60, messages=WEATHER_QUESTION,
                                tools=[WEATHER_TOOL], tool_choice={"type": "any"},
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    calls = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(calls) == 1, final
    jsonschema.validate(calls[0].input, WEATHER_TOOL["input_schema"])
