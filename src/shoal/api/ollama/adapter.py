"""The Ollama dialect: /api/chat and /api/generate bodies -> GenerationRequest, internal chunks
-> Ollama JSON or NDJSON lines."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from shoal.api.errors import APIError, invalid_parameter
from shoal.api.generation import collect_reply
from shoal.api.image_input import image_from_base64
from shoal.api.ollama.errors import error_body
from shoal.api.ollama.options import (
    OPTION_NAMES,
    keep_alive_seconds,
    response_format,
    sampling_values,
)
from shoal.api.ollama.schemas import (
    ChatRequest,
    GenerateRequest,
    GenerationFields,
    MessageIn,
)
from shoal.api.reasoning import effort_request
from shoal.api.sampling import build_sampling_params
from shoal.api.sse import ndjson_line
from shoal.api.tools import arguments_object, arguments_text, new_call_id, tool_spec
from shoal.protocol import (
    ChatMessage,
    FinishChunk,
    GenerationRequest,
    ImageInput,
    LogprobItem,
    ReasoningRequest,
    ToolCall,
)

Endpoint = Literal["chat", "generate"]

# Internal finish reasons -> Ollama's done_reason (a reply that called tools simply stopped).
_DONE_REASON = {"stop": "stop", "length": "length", "tool_calls": "stop", "abort": "stop"}


def new_request_id() -> str:
    return f"ollama-{uuid.uuid4().hex}"


def model_name(name: str) -> str:
    """Ollama treats "name" and "name:latest" as one model; so does shoal."""
    return name.removesuffix(":latest")


def timestamp() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


# ---- to_internal ----------------------------------------------------------------------------

def _check_common(body: GenerationFields) -> None:
    if body.top_logprobs and not body.logprobs:
        raise invalid_parameter("top_logprobs", "top_logprobs needs logprobs=true")


def _request(body: GenerationFields, request_id: str, **prompt: Any) -> GenerationRequest:
    _check_common(body)
    values = sampling_values(body.options)
    values.update(logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0)
    names = {**OPTION_NAMES, "top_logprobs": "top_logprobs"}
    return GenerationRequest(request_id=request_id, model=model_name(body.model),
                             sampling=build_sampling_params(values, names), stream=body.stream,
                             response_format=response_format(body.format),
                             reasoning=_reasoning(body.think),
                             keep_alive_s=keep_alive_seconds(body.keep_alive), **prompt)


def _reasoning(think: bool | str | None) -> ReasoningRequest | None:
    """think: true / false, or an effort ("low", "medium", "high"); None: the model's way."""
    if isinstance(think, bool):
        return ReasoningRequest(enabled=think, param="think")
    return effort_request(think, "think")


def _message(message: MessageIn, index: int) -> ChatMessage:
    where = f"messages.{index}"
    calls = tuple(
        ToolCall(id=call.id or new_call_id(), name=call.function.name,
                 arguments=arguments_text(call.function.arguments,
                                          f"{where}.tool_calls.{n}.function.arguments"))
        for n, call in enumerate(message.tool_calls or ()))
    return ChatMessage(role=message.role, content=message.content, tool_calls=calls,
                       images=_images(message.images, f"{where}.images"),
                       name=message.tool_name if message.role == "tool" else None,
                       reasoning=message.thinking or None)


def _images(images: list[str] | None, where: str) -> tuple[ImageInput, ...]:
    """Ollama's images: each a file in bare base64."""
    return tuple(image_from_base64(image, f"{where}.{n}") for n, image in enumerate(images or ()))


def chat_to_internal(body: ChatRequest, request_id: str) -> GenerationRequest:
    """The request for a chat with messages (an empty chat only loads the model)."""
    for n, tool in enumerate(body.tools or ()):
        if tool.type != "function":
            raise invalid_parameter(f"tools.{n}.type", f"tools of type {tool.type!r} are not "
                                                       f"supported; use function tools")
    tools = tuple(tool_spec(tool.function.name, tool.function.description,
                            tool.function.parameters, f"tools.{n}.function.name")
                  for n, tool in enumerate(body.tools or ()))
    messages = tuple(_message(m, i) for i, m in enumerate(body.messages))
    return _request(body, request_id, messages=messages, tools=tools)


def generate_to_internal(body: GenerateRequest, request_id: str) -> GenerationRequest:
    """A prompt, wrapped in the model's chat template unless raw (Ollama's behaviour)."""
    for name in ("suffix", "template"):
        if getattr(body, name):
            raise invalid_parameter(name, f"{name} is not supported")
    if body.context:
        raise invalid_parameter("context", "context is not supported; use /api/chat for "
                                           "multi-turn conversations")
    if body.raw:
        if body.images:
            raise invalid_parameter("images", "images need the model's chat template; a raw "
                                              "prompt cannot carry them")
        return _request(body, request_id, prompt=body.prompt)
    messages = [ChatMessage(role="system", content=body.system)] if body.system else []
    messages.append(ChatMessage(role="user", content=body.prompt,
                                images=_images(body.images, "images")))
    return _request(body, request_id, messages=tuple(messages))


# ---- from_internal --------------------------------------------------------------------------

def tool_call_json(index: int, call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "function": {"index": index, "name": call.name,
                                        "arguments": arguments_object(call)}}


def logprobs_json(items: list[LogprobItem] | tuple[LogprobItem, ...]) -> list[dict[str, Any]]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return [{**entry(i.token, i.logprob),
             "top_logprobs": [entry(t.token, t.logprob) for t in i.top]} for i in items]


@dataclass
class _Timings:
    """Monotonic nanosecond marks for Ollama's *_duration fields."""

    started: int = field(default_factory=time.monotonic_ns)  # the request arrived
    accepted: int = 0  # the runner took it (the model is loaded)
    first_token: int = 0
    finished: int = 0

    def durations(self) -> dict[str, int]:
        first = self.first_token or self.finished
        return {"total_duration": self.finished - self.started,
                "load_duration": self.accepted - self.started,
                "prompt_eval_duration": first - self.accepted,
                "eval_duration": self.finished - first}


@dataclass
class OllamaResponder:
    """Turns one request's internal chunks into Ollama JSON or NDJSON lines."""

    endpoint: Endpoint
    model: str
    want_logprobs: bool = False
    prompt_tokens: int = 0
    timings: _Timings = field(default_factory=_Timings)
    media_type = "application/x-ndjson"

    def keepalive_event(self) -> str:
        # An empty piece: NDJSON has no comments, and Ollama clients append empty text fine.
        return ndjson_line(self._piece(""))

    def _piece(self, text: str, tool_calls: list[dict[str, Any]] | None = None,
               logprobs: list[LogprobItem] | tuple[LogprobItem, ...] = (),
               thinking: str = "") -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "created_at": timestamp()}
        if self.endpoint == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            body["message"] = message
        else:
            body["response"] = text
            if thinking:
                body["thinking"] = thinking
        if self.want_logprobs and logprobs:
            body["logprobs"] = logprobs_json(logprobs)
        body["done"] = False
        return body

    def _done(self, body: dict[str, Any], finish: FinishChunk) -> dict[str, Any]:
        self.timings.finished = time.monotonic_ns()
        return {**body, "done": True, "done_reason": _DONE_REASON[finish.finish_reason],
                **self.timings.durations(),
                "prompt_eval_count": finish.usage.prompt_tokens,
                "eval_count": finish.usage.completion_tokens,
                **finish.usage.speculative_json()}

    def _mark(self, chunk: Any) -> None:
        if chunk.kind in ("token", "reasoning", "tool_call") and not self.timings.first_token:
            self.timings.first_token = time.monotonic_ns()

    async def _marked(self, chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
        self.timings.accepted = time.monotonic_ns()
        async for chunk in chunks:
            self._mark(chunk)
            yield chunk

    async def to_json(self, chunks: AsyncIterator[Any]) -> dict[str, Any]:
        reply = await collect_reply(self._marked(chunks))
        calls = [tool_call_json(i, call) for i, call in enumerate(reply.tool_calls)]
        return self._done(self._piece(reply.text, calls, reply.logprobs, reply.reasoning),
                          reply.finish)

    async def to_stream(self, chunks: AsyncIterator[Any]) -> AsyncIterator[str]:
        """One line per token or tool call, then a done line with counts and timings."""
        calls = 0
        async for chunk in self._marked(chunks):
            if chunk.kind == "token":
                yield ndjson_line(self._piece(chunk.text, logprobs=chunk.logprobs))
            elif chunk.kind == "reasoning":
                yield ndjson_line(self._piece("", thinking=chunk.text))
            elif chunk.kind == "tool_call":
                try:
                    call = tool_call_json(calls, chunk.call)
                except APIError as error:
                    yield ndjson_line(error_body(error))
                    return
                calls += 1
                yield ndjson_line(self._piece("", [call]))
            elif chunk.kind == "finish":
                yield ndjson_line(self._done(self._piece(""), chunk))
                return
            elif chunk.kind == "error":
                yield ndjson_line(error_body(APIError.from_chunk(chunk)))
                return
