"""POST /api/pull and DELETE /api/delete: the node's model store, in Ollama's format.

A pull runs on a worker thread (shoal.catalog.pull.puller.Puller) and its progress comes
back as Ollama's NDJSON status lines: "pulling manifest", "pulling <digest>" with total and
completed bytes, "verifying sha256 digest", "writing manifest", "success". The route waits
until the pull has been planned (the source answered, the disk has room) before it answers,
so a bad name, an unknown model, an unreachable source or a full disk is an {"error"} with
its own status; a failure after that ends the stream with an {"error"} line.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shoal.api.errors import APIError
from shoal.api.ollama.adapter import model_name
from shoal.api.ollama.errors import error_body
from shoal.api.ollama.schemas import ModelNameRequest
from shoal.api.sse import ndjson_line
from shoal.catalog.pull.errors import (
    CorruptDownload,
    NotEnoughDisk,
    NotOnSource,
    PullError,
    SourceUnreachable,
)
from shoal.catalog.pull.progress import PullEvent
from shoal.catalog.pull.puller import Puller
from shoal.catalog.resolve import ModelNotFound, data_dir_or_default

router = APIRouter()

_DONE = object()  # the worker's last queue item


def puller_of(request: Request) -> Puller:
    """The node's puller; an app built without one pulls into the default data dir."""
    state = request.app.state
    if getattr(state, "puller", None) is None:
        state.puller = Puller(data_dir_or_default(None))
    return state.puller


def as_api_error(error: BaseException, name: str) -> APIError:
    """A pull's failure in the API's terms (never a 500 for what a user or a source did)."""
    if isinstance(error, (NotOnSource, ModelNotFound)):
        return APIError(404, str(error), param="model", code="model_not_found")
    if isinstance(error, NotEnoughDisk):
        return APIError(507, str(error), code="insufficient_storage", error_type="server_error")
    if isinstance(error, (SourceUnreachable, CorruptDownload, PullError)):
        return APIError(502, str(error), code="pull_failed", error_type="server_error")
    if isinstance(error, ValueError):
        return APIError(400, str(error), param="model", code="invalid_parameter")
    return APIError(500, f"pull {name!r} failed: {error}", error_type="internal_error")


@router.post("/api/pull")
async def pull(body: ModelNameRequest, request: Request) -> Response:
    name = model_name(body.model_name)
    if not name:
        raise APIError(400, "model is required", param="model", code="invalid_parameter")
    puller = puller_of(request)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def report(event: PullEvent) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, event)

    async def work() -> None:
        try:
            await asyncio.to_thread(puller.pull, name, report)
        finally:
            queue.put_nowait(_DONE)

    task = asyncio.ensure_future(work())
    if not body.stream:
        try:
            await asyncio.shield(task)
        except Exception as error:  # noqa: BLE001 - every failure becomes an answer
            raise as_api_error(error, name) from None
        return JSONResponse({"status": "success"})
    early = await _until_planned(queue)
    if early[-1] is _DONE:  # over before it counted a byte: a failure keeps its status
        await asyncio.wait([task])
        if task.exception() is not None:
            raise as_api_error(task.exception(), name)
    return StreamingResponse(_lines(early, queue, task, name),
                             media_type="application/x-ndjson")


async def _until_planned(queue: asyncio.Queue) -> list[Any]:
    """The events up to the first that counts bytes (the pull is planned) or the end."""
    events = []
    while True:
        event = await queue.get()
        events.append(event)
        if event is _DONE or event.total is not None or event.status == "success":
            return events


async def _lines(events: list[Any], queue: asyncio.Queue, task: asyncio.Future,
                 name: str) -> AsyncIterator[str]:
    while True:
        for event in events:
            if event is _DONE:
                await asyncio.wait([task])
                if task.exception() is not None:
                    yield ndjson_line(error_body(as_api_error(task.exception(), name)))
                return
            yield ndjson_line(event.to_json())
        events = [await queue.get()]


@router.delete("/api/delete")
async def delete(body: ModelNameRequest, request: Request) -> Response:
    """Remove a pulled model from this node's store (Ollama answers 200 with no body)."""
    name = model_name(body.model_name)
    if not name:
        raise APIError(400, "model is required", param="model", code="invalid_parameter")
    try:
        await asyncio.to_thread(puller_of(request).remove, name)
    except ModelNotFound as error:
        raise APIError(404, str(error), param="model", code="model_not_found") from None
    return Response(status_code=200)
