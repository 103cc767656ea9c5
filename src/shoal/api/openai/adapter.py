"""The OpenAI dialect: request bodies -> GenerationRequest, internal chunks -> JSON / SSE."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from shoal.api.errors import APIError, invalid_parameter
from shoal.api.generation import SSEResponder, collect_reply
from shoal.api.image_input import image_from_url
from shoal.api.ollama.options import keep_alive_seconds
from shoal.api.openai.schemas import (
    ChatCompletionRequest,
    ChatMessageIn,
    CompletionRequest,
    SamplingFields,
)
from shoal.api.openai.tool_fields import (
    check_tool_call_id,
    internal_response_format,
    internal_tool_calls,
    internal_tool_choice,
    internal_tools,
    tool_call_delta,
    tool_call_json,
)
from shoal.api.reasoning import effort_request
from shoal.api.sampling import build_sampling_params, stop_strings
from shoal.api.sse import DONE, sse_event
from shoal.api.tools import limit_tool_calls
from shoal.engine.sampling import SamplingParams
from shoal.protocol import ChatMessage, GenerationRequest, ImageInput, LogprobItem, Usage

# OpenAI's documented default for the legacy completions endpoint.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

Dialect = Literal["chat", "completion"]


def new_request_id(dialect: Dialect) -> str:
    prefix = "chatcmpl" if dialect == "chat" else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- to_internal ----------------------------------------------------------------------------

def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    bias: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            bias[int(key)] = float(value)
        except ValueError:
            raise invalid_parameter("logit_bias", f"logit_bias keys must be token ids, "
                                                  f"not {key!r}") from None
    return bias


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: bool,
                    top_logprobs: int) -> SamplingParams:
    """SamplingParams from the shared fields; APIError(400) naming the bad parameter."""
    if body.n not in (None, 1):
        raise invalid_parameter("n", "only n=1 is supported")
    values: dict[str, Any] = {
        name: getattr(body, name)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "seed", "min_tokens",
                     "ignore_eos")
    }
    return build_sampling_params({**values, "max_tokens": max_tokens,
                                  "stop": stop_strings(body.stop),
                                  "logit_bias": _logit_bias(body.logit_bias),
                                  "logprobs": logprobs, "top_logprobs": top_logprobs})


def _message_content(message: ChatMessageIn, index: int) -> tuple[str, tuple[ImageInput, ...]]:
    """The turn's text and images (image_url parts, data URLs only)."""
    if message.content is None or isinstance(message.content, str):
        return message.content or "", ()
    parts, images = [], []
    for n, part in enumerate(message.content):
        where = f"messages.{index}.content.{n}"
        if part.type == "image_url" and part.image_url is not None:
            images.append(image_from_url(part.image_url.url, f"{where}.image_url.url"))
        elif part.type == "text" and part.text is not None:
            parts.append(part.text)
        else:
            raise invalid_parameter(f"{where}.type",
                                    f"content parts of type {part.type!r} are not supported")
    return "".join(parts), tuple(images)


def chat_to_internal(body: ChatCompletionRequest, request_id: str) -> GenerationRequest:
    if body.top_logprobs and not body.logprobs:
        raise invalid_parameter("top_logprobs", "top_logprobs needs logprobs=true")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    params = sampling_params(body, max_tokens, bool(body.logprobs), body.top_logprobs or 0)
    messages = tuple(_chat_message(m, i) for i, m in enumerate(body.messages))
    tools = internal_tools(body)
    return GenerationRequest(request_id=request_id, model=body.model, messages=messages,
                             sampling=params, stream=body.stream, tools=tools,
                             tool_choice=internal_tool_choice(body, tools),
                             response_format=internal_response_format(body.response_format),
                             reasoning=effort_request(body.reasoning_effort,
                                                      "reasoning_effort"),
                             keep_alive_s=keep_alive_seconds(body.keep_alive))


def _chat_message(message: ChatMessageIn, index: int) -> ChatMessage:
    check_tool_call_id(message, index)
    text, images = _message_content(message, index)
    return ChatMessage(role=message.role, content=text, images=images, name=message.name,
                       tool_calls=internal_tool_calls(message, index),
                       tool_call_id=message.tool_call_id,
                       reasoning=message.reasoning_content or message.reasoning or None)


def completion_to_internal(body: CompletionRequest, request_id: str) -> GenerationRequest:
    if body.echo:
        raise invalid_parameter("echo", "echo is not supported")
    if body.suffix:
        raise invalid_parameter("suffix", "suffix is not supported")
    if body.best_of not in (None, 1):
        raise invalid_parameter("best_of", "only best_of=1 is supported")
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    params = sampling_params(body, max_tokens, body.logprobs is not None, body.logprobs or 0)
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one
    common = dict(request_id=request_id, model=body.model, sampling=params, stream=body.stream,
                  keep_alive_s=keep_alive_seconds(body.keep_alive))
    if isinstance(prompt, str):
        return GenerationRequest(prompt=prompt, **common)
    if prompt and all(isinstance(t, int) for t in prompt):
        return GenerationRequest(prompt_token_ids=tuple(prompt), **common)
    raise invalid_parameter("prompt", "prompt must be one string or one list of token ids "
                                      "(batched prompts are not supported)")


# ---- from_internal --------------------------------------------------------------------------

def usage_json(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            **reasoning_usage_json(usage, "completion_tokens_details"),
            **usage.speculative_json()}


def reasoning_usage_json(usage: Usage, field_name: str) -> dict[str, Any]:
    """The reasoning tokens under field_name; {} for a reply without reasoning."""
    if not usage.reasoning_tokens:
        return {}
    return {field_name: {"reasoning_tokens": usage.reasoning_tokens}}


def chat_logprobs(items: list[LogprobItem] | tuple[LogprobItem, ...]) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(i.token, i.logprob),
                         "top_logprobs": [entry(t.token, t.logprob) for t in i.top]}
                        for i in items]}


def completion_logprobs(items: list[LogprobItem] | tuple[LogprobItem, ...],
                        start_offset: int = 0) -> dict[str, Any]:
    offsets, offset = [], start_offset
    for item in items:
        offsets.append(offset)
        offset += len(item.token)
    return {"tokens": [i.token for i in items], "token_logprobs": [i.logprob for i in items],
            "top_logprobs": [{t.token: t.logprob for t in i.top} for i in items],
            "text_offset": offsets}


@dataclass
class OpenAIResponder(SSEResponder):
    """Turns one request's internal chunks into OpenAI JSON or SSE events."""

    dialect: Dialect
    request_id: str
    model: str
    want_logprobs: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = 0
    parallel_tool_calls: bool = True  # False: only the first call is returned

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.dialect == "chat" else "text_completion"

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created,
                "model": self.model}

    def _logprobs(self, items, start_offset: int = 0) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        if self.dialect == "chat":
            return chat_logprobs(items)
        return completion_logprobs(items, start_offset)

    async def to_json(self, chunks: AsyncIterator[Any]) -> dict[str, Any]:
        """The whole response; APIError if the stream ends in an error."""
        reply = await collect_reply(limit_tool_calls(chunks, self.parallel_tool_calls))
        finish = reply.finish
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(reply.logprobs),
                                  "finish_reason": finish.finish_reason}
        if self.dialect == "chat":
            choice["message"] = {"role": "assistant", "content": reply.text}
            if reply.tool_calls:
                choice["message"] = {"role": "assistant", "content": reply.text or None,
                                     "tool_calls": [tool_call_json(c) for c in reply.tool_calls]}
            if reply.reasoning:
                choice["message"]["reasoning_content"] = reply.reasoning
        else:
            choice["text"] = reply.text
        return {**self._envelope(self.object_name), "choices": [choice],
                "usage": usage_json(finish.usage)}

    async def to_stream(self, chunks: AsyncIterator[Any]) -> AsyncIterator[str]:
        """SSE events: deltas, a final finish_reason, optional usage, then [DONE]."""
        offset = 0
        if self.dialect == "chat":
            yield self._sse_chunk({"role": "assistant", "content": ""}, None, None)
        async for chunk in limit_tool_calls(chunks, self.parallel_tool_calls):
            if chunk.kind == "token":
                yield self._sse_chunk(chunk.text, self._logprobs(chunk.logprobs, offset), None)
                offset += len(chunk.text)
            elif chunk.kind == "reasoning" and self.dialect == "chat":
                yield self._sse_chunk({"reasoning_content": chunk.text}, None, None)
            elif chunk.kind == "tool_call":
                yield self._sse_chunk(tool_call_delta(chunk.index, chunk.call), None, None)
            elif chunk.kind == "finish":
                yield self._sse_chunk("", None, chunk.finish_reason)
                if self.include_usage:
                    yield sse_event({**self._envelope(self._chunk_object), "choices": [],
                                     "usage": usage_json(chunk.usage)})
                break
            elif chunk.kind == "error":
                yield sse_event(APIError.from_chunk(chunk).body())
                break
        yield DONE

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.dialect == "chat" else "text_completion"

    def _sse_chunk(self, delta: str | dict[str, Any], logprobs: dict[str, Any] | None,
                   finish_reason: str | None) -> str:
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs,
                                  "finish_reason": finish_reason}
        if self.dialect == "chat":
            if isinstance(delta, str):
                delta = {"content": delta} if delta else {}
            choice["delta"] = delta
        else:
            choice["text"] = delta
        event = {**self._envelope(self._chunk_object), "choices": [choice]}
        if self.include_usage:
            event["usage"] = None
        return sse_event(event)
