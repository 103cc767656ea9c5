"""POST /v1/messages and POST /v1/messages/count_tokens (Anthropic's Messages API)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from shoal.api.admission import admitted
from shoal.api.anthropic.adapter import (
    allows_parallel_tool_use,
    new_message_id,
    to_internal,
)
from shoal.api.anthropic.responder import AnthropicResponder
from shoal.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from shoal.api.generation import (
    CLIENT_CLOSED_REQUEST,
    ClientGone,
    count_prompt_tokens,
    respond,
)

router = APIRouter()


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request) -> Response:
    state = request.app.state
    internal = admitted(to_internal(body, new_message_id()), request, body)
    responder = AnthropicResponder(message_id=internal.request_id, model=body.model,
                                   parallel_tool_use=allows_parallel_tool_use(body))
    return await respond(request, state.router, internal, responder, state.keepalive_s)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    internal = admitted(to_internal(body, new_message_id()), request, body)
    try:
        tokens = await count_prompt_tokens(request, request.app.state.router, internal)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse({"input_tokens": tokens})
