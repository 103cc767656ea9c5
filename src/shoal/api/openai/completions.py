"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from shoal.api.admission import admitted
from shoal.api.generation import respond
from shoal.api.openai.adapter import (
    OpenAIResponder,
    completion_to_internal,
    new_request_id,
)
from shoal.api.openai.schemas import CompletionRequest

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = request.app.state
    internal = admitted(completion_to_internal(body, new_request_id("completion")), request,
                        body)
    responder = OpenAIResponder(
        dialect="completion", request_id=internal.request_id,
        model=body.model, want_logprobs=body.logprobs is not None,
        include_usage=bool(body.stream_options and body.stream_options.include_usage))
    return await respond(request, state.router, internal, responder, state.keepalive_s)
