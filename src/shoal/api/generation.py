"""Running one generation for an HTTP request, whatever the dialect.

The request's internal stream is opened and its first chunk awaited (so validation errors get
a proper status code before any body is sent); then the body is streamed (SSE or NDJSON, as
the dialect's Responder says) or collected.
A client that goes away cancels its request in the runner: streaming through Starlette's
disconnect listener cancelling the body iterator, non-streaming by polling is_disconnected().
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shoal.api.errors import APIError
from shoal.api.sse import KEEPALIVE, with_keepalive
from shoal.protocol import (
    AcceptedChunk,
    FinishChunk,
    GenerationRequest,
    LogprobItem,
    ToolCall,
)

T = TypeVar("T")
DISCONNECT_POLL_S = 0.25
# Not an HTTP status anyone reads: the client is gone (nginx's convention).
CLIENT_CLOSED_REQUEST = 499


class ClientGone(Exception):
    """The HTTP client disconnected while we were waiting on its request."""


async def until_disconnect(http_request: Request, awaitable: Awaitable[T]) -> T:
    """awaitable's result; cancels it and raises ClientGone if the client disconnects."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http_request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def open_stream(http_request: Request, router: Any, internal: GenerationRequest
                      ) -> tuple[AcceptedChunk, AsyncIterator[Any]]:
    """The request's AcceptedChunk and its chunk stream after it; APIError if it was refused."""
    stream = router.submit(internal)
    try:
        first = await until_disconnect(http_request, anext(stream))
    except StopAsyncIteration:
        raise APIError(500, "the request ended without a reply", code="internal",
                       error_type="internal_error") from None
    except BaseException:
        await stream.aclose()
        raise
    if first.kind == "error":
        await stream.aclose()
        raise APIError.from_chunk(first)
    if first.kind != "accepted":
        await stream.aclose()
        raise APIError(500, f"the request began with a {first.kind} chunk, not accepted",
                       code="internal", error_type="internal_error")
    return first, stream


class Responder(Protocol):
    """A dialect's view of one request: its JSON body and its streamed events.

    respond() sets model (the canonical id) and prompt_tokens before reading either.
    """

    model: str
    prompt_tokens: int
    media_type: str  # of the streamed body

    def keepalive_event(self) -> str:
        """What to send when the stream has been silent for a while."""
        ...

    async def to_json(self, chunks: AsyncIterator[Any]) -> dict[str, Any]: ...

    def to_stream(self, chunks: AsyncIterator[Any]) -> AsyncIterator[str]: ...


class SSEResponder:
    """Defaults for dialects that stream server-sent events."""

    media_type = "text/event-stream"

    def keepalive_event(self) -> str:
        return KEEPALIVE


@dataclass
class Reply:
    """A whole generation, collected for a non-streaming answer."""

    text: str
    logprobs: list[LogprobItem]
    tool_calls: list[ToolCall]
    finish: FinishChunk
    reasoning: str = ""  # a reasoning model's reasoning, kept apart from the answer


async def collect_reply(chunks: AsyncIterator[Any]) -> Reply:
    """Every chunk after AcceptedChunk gathered into one Reply; APIError on an error chunk."""
    text: list[str] = []
    reasoning: list[str] = []
    logprobs: list[LogprobItem] = []
    tool_calls: list[ToolCall] = []
    async for chunk in chunks:
        if chunk.kind == "error":
            raise APIError.from_chunk(chunk)
        if chunk.kind == "token":
            text.append(chunk.text)
            logprobs.extend(chunk.logprobs)
        elif chunk.kind == "reasoning":
            reasoning.append(chunk.text)
        elif chunk.kind == "tool_call":
            tool_calls.append(chunk.call)
        elif chunk.kind == "finish":
            return Reply("".join(text), logprobs, tool_calls, chunk, "".join(reasoning))
    raise APIError(500, "the runner ended the stream without finishing", code="internal",
                   error_type="internal_error")


async def count_prompt_tokens(http_request: Request, router: Any,
                              internal: GenerationRequest) -> int:
    """The prompt's token count as the model sees it (chat template applied); loads the model
    if needed. Raises APIError like a generation would, ClientGone if the client left."""
    accepted, stream = await open_stream(
        http_request, router, internal.model_copy(update={"count_only": True, "stream": False}))
    await stream.aclose()
    return accepted.prompt_tokens


async def respond(http_request: Request, router: Any, internal: GenerationRequest,
                  responder: Responder, keepalive_s: float) -> Response:
    try:
        accepted, stream = await open_stream(http_request, router, internal)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    # Only now is the name resolved: answer with the canonical id, not the alias asked for.
    responder.model = accepted.model or router.canonical_id(internal.model)
    responder.prompt_tokens = accepted.prompt_tokens
    to_json, to_stream = responder.to_json, responder.to_stream
    if internal.stream:
        events = with_keepalive(_closing(to_stream(stream), stream), keepalive_s,
                                responder.keepalive_event())
        return StreamingResponse(events, media_type=responder.media_type,
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})
    try:
        body = await until_disconnect(http_request, to_json(stream))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        await stream.aclose()
    return JSONResponse(body)


async def _closing(events: AsyncIterator[str], stream: AsyncIterator[Any]) -> AsyncIterator[str]:
    """events, then always close the underlying chunk stream (which cancels if unfinished)."""
    try:
        async for event in events:
            yield event
    finally:
        await events.aclose()
        await stream.aclose()
