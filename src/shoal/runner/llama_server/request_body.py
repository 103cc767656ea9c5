"""A GenerationRequest as llama-server's HTTP API takes it.

A chat goes to `/v1/chat/completions` (llama-server renders the model's template with
--jinja, tools included, and parses tool calls and reasoning out of the reply); a prompt or
prompt token ids go to the native `/completion`, which streams token ids too. Both stream
and report prompt progress, so the first event says how long the prompt is.

What llama-server cannot honour is UnsupportedByLlamaServer (the dialect's 400), never
dropped in silence.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from shoal.protocol import ChatMessage, ForcedTool, GenerationRequest, ResponseFormat


class UnsupportedByLlamaServer(ValueError):
    """The request asks for something llama-server cannot do; param names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class LlamaServerCall:
    path: str  # "/v1/chat/completions" or "/completion"
    body: dict[str, Any]

    @property
    def chat(self) -> bool:
        return self.path == "/v1/chat/completions"


def to_llama_server(request: GenerationRequest) -> LlamaServerCall:
    """The HTTP call that serves request (UnsupportedByLlamaServer if none can)."""
    body = {"stream": True, "return_progress": True, **_sampling(request)}
    if request.messages is not None:
        body |= _chat(request)
        body["stream_options"] = {"include_usage": True}
        return LlamaServerCall("/v1/chat/completions", body)
    if request.tools:
        raise UnsupportedByLlamaServer("tools", "tools need a chat (messages), not a prompt")
    if request.reasoning is not None and request.reasoning.enabled:
        raise UnsupportedByLlamaServer(request.reasoning.param,
                                       "reasoning needs a chat (messages), not a prompt")
    prompt: Any = request.prompt if request.prompt is not None else list(
        request.prompt_token_ids or ())
    body |= {"prompt": prompt, "return_tokens": True, "cache_prompt": True}
    if request.response_format is not None and request.response_format.type != "text":
        body["json_schema"] = _schema_of(request.response_format)
    # The native endpoint calls max_tokens n_predict (-1: until the context is full).
    body["n_predict"] = body.pop("max_tokens", -1)
    return LlamaServerCall("/completion", body)


def _sampling(request: GenerationRequest) -> dict[str, Any]:
    params = request.sampling
    if params.logprobs or params.top_logprobs:
        raise UnsupportedByLlamaServer("logprobs", "logprobs are not available from a model "
                                       "served by llama-server")
    if params.min_tokens:
        raise UnsupportedByLlamaServer("min_tokens", "llama-server has no min_tokens")
    if params.stop_token_ids:
        raise UnsupportedByLlamaServer("stop_token_ids", "llama-server stops on strings only, "
                                       "not on token ids")
    if params.speculative is not None:
        raise UnsupportedByLlamaServer("speculative", "per-request speculative decoding is "
                                       "shoal's engine's; llama-server sets its own at start")
    body: dict[str, Any] = {
        # llama.cpp samples greedily at temperature <= 0, as shoal's engine does at 0.
        "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
        # Given always: llama-server's own default min_p is 0.05, shoal's 0.
        "min_p": params.min_p, "repeat_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "stop": list(params.stop), "ignore_eos": params.ignore_eos,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.max_tokens is not None:
        body["max_tokens"] = params.max_tokens
    if params.logit_bias:
        body["logit_bias"] = [[token, bias] for token, bias in params.logit_bias.items()]
    return body


def _chat(request: GenerationRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [_message(m) for m in request.messages or ()]}
    tools, choice = request.tools, request.tool_choice
    if isinstance(choice, ForcedTool):
        # llama-server takes tool_choice as a word only: offering just the named function
        # and requiring a call forces exactly that call.
        tools = tuple(t for t in tools if t.name == choice.name)
        if not tools:
            raise UnsupportedByLlamaServer("tool_choice", f"tool_choice names {choice.name!r}, "
                                           "which is not among the tools")
        choice = "required"
    if tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description,
            "parameters": t.parameters or {"type": "object", "properties": {}}}}
            for t in tools]
        body["tool_choice"] = choice
    if request.response_format is not None and request.response_format.type != "text":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "schema": _schema_of(request.response_format)}}
    if request.reasoning is not None:
        kwargs: dict[str, Any] = {"enable_thinking": request.reasoning.enabled}
        if request.reasoning.effort is not None:
            kwargs["reasoning_effort"] = request.reasoning.effort
        body["chat_template_kwargs"] = kwargs
    return body


def _schema_of(response_format: ResponseFormat) -> dict[str, Any]:
    if response_format.type == "json_schema":
        return dict(response_format.json_schema or {})
    return {"type": "object"}  # json_object: any JSON object


def _message(message: ChatMessage) -> dict[str, Any]:
    # Chat templates know system, user, assistant and tool; a developer turn is the system's.
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": _content(message)}
    if message.name is not None:
        out["name"] = message.name
    if message.reasoning:
        out["reasoning_content"] = message.reasoning
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _content(message: ChatMessage) -> str | list[dict[str, Any]]:
    """The text, or with images OpenAI's content parts: each image a data URL, then the
    text (llama-server puts each image's tokens where its part stands)."""
    if not message.images:
        return message.content
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {
            "url": f"data:{image.media_type};base64,{base64.b64encode(image.data).decode()}"}}
        for image in message.images]
    return parts + [{"type": "text", "text": message.content}]
