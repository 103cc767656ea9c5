"""Running one generation for an HTTP request, whatever the dialect.

The request's internal stream is opened and its first chunk awaited (so validation errors get
a proper status code before any body is sent); then the body is streamed (SSE) or collected.
A client that goes away cancels its request in the runner: streaming through Starlette's
disconnect listener cancelling the body iterator, non-streaming by polling is_disconnected().
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shoal.api.errors import APIError
from shoal.api.sse import with_keepalive
from shoal.protocol import GenerationRequest

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


async def open_stream(http_request: Request, router: Any,
                      internal: GenerationRequest) -> AsyncIterator[Any]:
    """The request's chunk stream after its AcceptedChunk; APIError if it was refused."""
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
    return stream


class Responder(Protocol):
    """A dialect's view of one request: its model name, JSON body and SSE events."""

    model: str

    async def to_json(self, chunks: AsyncIterator[Any]) -> dict[str, Any]: ...

    def to_sse(self, chunks: AsyncIterator[Any]) -> AsyncIterator[str]: ...


async def respond(http_request: Request, router: Any, internal: GenerationRequest,
                  responder: Responder, keepalive_s: float) -> Response:
    try:
        stream = await open_stream(http_request, router, internal)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    # Only now is the name resolved: answer with the canonical id, not the alias asked for.
    responder.model = router.canonical_id(internal.model)
    to_json, to_sse = responder.to_json, responder.to_sse
    if internal.stream:
        return StreamingResponse(with_keepalive(_closing(to_sse(stream), stream), keepalive_s),
                                 media_type="text/event-stream",
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
