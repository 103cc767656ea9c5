"""llama-server's side of the wire without a process: requests as it takes them, its events
as chunks, its device list."""

import pytest

from shoal.engine.sampling import SamplingParams
from shoal.protocol import (
    ChatMessage,
    ForcedTool,
    GenerationRequest,
    ResponseFormat,
    ToolCall,
    ToolSpec,
)
from shoal.runner.llama_server.binary import parse_devices
from shoal.runner.llama_server.events import EventReader, error_chunk
from shoal.runner.llama_server.request_body import UnsupportedByLlamaServer, to_llama_server

WEATHER = ToolSpec(name="get_weather", description="weather in a city",
                   parameters={"type": "object", "properties": {"city": {"type": "string"}}})


def chat(**fields):
    return GenerationRequest(request_id="r1", model="m",
                             messages=(ChatMessage(role="user", content="hi"),), **fields)


def test_a_chat_goes_to_chat_completions_with_tools_sampling_and_schema():
    call = to_llama_server(chat(
        sampling=SamplingParams(temperature=0.0, seed=7, max_tokens=12, stop=("\n",)),
        tools=(WEATHER,), tool_choice="required",
        response_format=ResponseFormat(type="json_schema", json_schema={"type": "object"})))
    body = call.body
    assert call.path == "/v1/chat/completions" and call.chat
    assert body["stream"] and body["return_progress"]
    assert body["stream_options"] == {"include_usage": True}
    assert (body["temperature"], body["seed"], body["max_tokens"], body["stop"]) == \
        (0.0, 7, 12, ["\n"])
    assert body["min_p"] == 0.0  # given always: llama-server's default differs
    assert body["tools"][0]["function"]["name"] == "get_weather"
    assert body["tool_choice"] == "required"
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"schema": {"type": "object"}}}


def test_a_forced_tool_offers_only_that_tool_and_requires_a_call():
    other = ToolSpec(name="other")
    body = to_llama_server(chat(tools=(WEATHER, other),
                                tool_choice=ForcedTool(name="other"))).body
    assert [t["function"]["name"] for t in body["tools"]] == ["other"]
    assert body["tool_choice"] == "required"


def test_past_turns_keep_their_calls_and_a_developer_turn_is_the_systems():
    messages = (ChatMessage(role="developer", content="be brief"),
                ChatMessage(role="assistant", content="",
                            tool_calls=(ToolCall(id="c1", name="f", arguments="{}"),)),
                ChatMessage(role="tool", content="42", tool_call_id="c1"))
    sent = to_llama_server(GenerationRequest(request_id="r", model="m",
                                             messages=messages)).body["messages"]
    assert sent[0] == {"role": "system", "content": "be brief"}
    assert sent[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert sent[2]["tool_call_id"] == "c1"


def test_a_prompt_goes_to_the_native_completion_with_n_predict():
    call = to_llama_server(GenerationRequest(
        request_id="r", model="m", prompt="Once", sampling=SamplingParams(max_tokens=5)))
    assert call.path == "/completion" and not call.chat
    assert call.body["prompt"] == "Once" and call.body["n_predict"] == 5
    assert "max_tokens" not in call.body and call.body["return_tokens"]
    ids = to_llama_server(GenerationRequest(request_id="r", model="m",
                                            prompt_token_ids=(1, 2, 3))).body
    assert ids["prompt"] == [1, 2, 3] and ids["n_predict"] == -1


@pytest.mark.parametrize("fields, param", [
    ({"sampling": SamplingParams(logprobs=True)}, "logprobs"),
    ({"sampling": SamplingParams(min_tokens=3)}, "min_tokens"),
    ({"sampling": SamplingParams(stop_token_ids=(2,))}, "stop_token_ids"),
])
def test_what_llama_server_cannot_honour_is_refused_by_name(fields, param):
    with pytest.raises(UnsupportedByLlamaServer) as refused:
        to_llama_server(chat(**fields))
    assert refused.value.param == param


def test_chat_events_become_accepted_deltas_tool_calls_and_a_finish_with_usage():
    reader = EventReader("r1", chat=True, model="m")
    chunks = reader.feed({"choices": [{"delta": {"role": "assistant", "content": None}}],
                          "prompt_progress": {"total": 9, "cache": 0, "processed": 0}})
    chunks += reader.feed({"choices": [{"delta": {"reasoning_content": "hmm"}}]})
    chunks += reader.feed({"choices": [{"delta": {"content": "Hel"}}]})
    chunks += reader.feed({"choices": [{"delta": {"tool_calls": [
        {"index": 0, "id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\""}}]}}]})
    chunks += reader.feed({"choices": [{"delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": ": \"Paris\"}"}}]}}]})
    chunks += reader.feed({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    assert not reader.finished  # the usage event is still to come
    chunks += reader.feed({"choices": [], "usage": {
        "prompt_tokens": 9, "completion_tokens": 4, "prompt_tokens_details":
        {"cached_tokens": 2}}})
    assert [c.kind for c in chunks] == ["accepted", "reasoning", "token", "tool_call",
                                        "finish"]
    assert chunks[0].prompt_tokens == 9 and chunks[0].model == "m"
    assert chunks[3].call.name == "get_weather"
    assert chunks[3].call.arguments == '{"city": "Paris"}' and chunks[3].call.id == "call_a"
    finish = chunks[-1]
    assert finish.finish_reason == "tool_calls"
    assert (finish.usage.prompt_tokens, finish.usage.completion_tokens,
            finish.usage.cached_tokens) == (9, 4, 2)
    assert reader.close() == []


def test_native_events_carry_token_ids_and_the_stop_word():
    reader = EventReader("r1", chat=False)
    chunks = reader.feed({"content": "", "tokens": [], "stop": False,
                          "prompt_progress": {"total": 3}})
    chunks += reader.feed({"content": " upon", "tokens": [5], "stop": False})
    chunks += reader.feed({"content": "", "tokens": [], "stop": True, "stop_type": "word",
                           "stopping_word": "\n", "tokens_evaluated": 3,
                           "tokens_predicted": 2, "tokens_cached": 0})
    assert [c.kind for c in chunks] == ["accepted", "token", "finish"]
    assert chunks[1].token_ids == (5,) and chunks[1].text == " upon"
    assert chunks[2].finish_reason == "stop" and chunks[2].stop_sequence == "\n"
    assert chunks[2].usage.completion_tokens == 2


def test_a_stream_cut_short_stays_unfinished_and_errors_keep_their_meaning():
    reader = EventReader("r1", chat=True)
    reader.feed({"choices": [{"delta": {"content": "x"}}], "prompt_progress": {"total": 1}})
    assert reader.close() == [] and not reader.finished
    reader.feed({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    assert [c.kind for c in reader.close()] == ["finish"]  # no usage event came
    too_long = error_chunk("r1", {"code": 400, "message": "too long",
                                  "type": "exceed_context_size_error"})
    assert too_long.code == "context_length_exceeded"
    assert error_chunk("r1", {"code": 400, "message": "bad"}).code == "invalid_request"
    assert EventReader("r1", chat=True).feed({"error": {"code": 500, "message": "boom"}}
                                             )[0].code == "internal"


def test_devices_are_read_from_list_devices():
    listing = ("Available devices:\n"
               "  CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23500 MiB free)\n")
    (device,) = parse_devices(listing)
    assert device.name == "CUDA0" and device.description == "NVIDIA GeForce RTX 4090"
    assert device.total_bytes == 24080 << 20 and device.free_bytes == 23500 << 20
    assert parse_devices("Available devices:\n  (none)\n") == ()
