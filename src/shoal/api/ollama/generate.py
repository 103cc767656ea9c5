"""POST /api/chat and POST /api/generate (NDJSON streams unless "stream": false).

A chat without messages or a generate with an empty prompt only loads the model, or with
keep_alive 0 unloads it once idle (shoal.router.Router.load), answering done_reason "load" /
"unload".
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from shoal.api.admission import admitted
from shoal.api.errors import APIError
from shoal.api.generation import (
    CLIENT_CLOSED_REQUEST,
    ClientGone,
    respond,
    until_disconnect,
)
from shoal.api.ollama.adapter import (
    Endpoint,
    OllamaResponder,
    chat_to_internal,
    generate_to_internal,
    new_request_id,
    timestamp,
)
from shoal.api.ollama.model_defaults import with_model_defaults
from shoal.api.ollama.schemas import ChatRequest, GenerateRequest
from shoal.api.sse import ndjson_line
from shoal.catalog.resolve import ModelNotFound
from shoal.protocol import GenerationRequest
from shoal.router import ModelUnavailable

router = APIRouter()


@router.post("/api/chat")
async def chat(body: ChatRequest, request: Request) -> Response:
    body = with_model_defaults(body, request)
    internal = admitted(chat_to_internal(body, new_request_id()), request, body)
    if not internal.messages:
        return await _load(request, internal, "chat")
    return await _respond(request, internal, "chat", body.logprobs)


@router.post("/api/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    body = with_model_defaults(body, request)
    internal = admitted(generate_to_internal(body, new_request_id()), request, body)
    if not body.prompt and not body.system:
        return await _load(request, internal, "generate")
    return await _respond(request, internal, "generate", body.logprobs)


async def _respond(request: Request, internal: GenerationRequest, endpoint: Endpoint,
                   logprobs: bool | None) -> Response:
    state = request.app.state
    responder = OllamaResponder(endpoint=endpoint, model=internal.model,
                                want_logprobs=bool(logprobs))
    return await respond(request, state.router, internal, responder, state.keepalive_s)


async def _load(request: Request, internal: GenerationRequest, endpoint: Endpoint) -> Response:
    """Load the model (keep_alive applies), or with keep_alive 0 unload it once idle."""
    router = request.app.state.router
    try:
        await until_disconnect(request, router.load(internal.model, internal.keep_alive_s))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except ModelNotFound as error:
        raise APIError(404, str(error), param="model", code="model_not_found") from None
    except ModelUnavailable as error:
        raise APIError(503, str(error), code="unavailable",
                       error_type="service_unavailable") from None
    except ValueError as error:  # an embedding model, a malformed name
        raise APIError(400, str(error), param="model", code="invalid_parameter") from None
    body: dict[str, Any] = {"model": router.canonical_id(internal.model),
                            "created_at": timestamp()}
    if endpoint == "chat":
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    body.update(done=True, done_reason="unload" if internal.keep_alive_s == 0 else "load")
    if internal.stream:
        return Response(ndjson_line(body), media_type="application/x-ndjson")
    return JSONResponse(body)
