"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from shoal.api.admission import admitted
from shoal.api.generation import respond
from shoal.api.openai.adapter import OpenAIResponder, chat_to_internal, new_request_id
from shoal.api.openai.schemas import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = request.app.state
    internal = admitted(chat_to_internal(body, new_request_id("chat")), request, body)
    responder = OpenAIResponder(
        dialect="chat", request_id=internal.request_id,
        model=body.model, want_logprobs=bool(body.logprobs),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        parallel_tool_calls=body.parallel_tool_calls is not False)
    return await respond(request, state.router, internal, responder, state.keepalive_s)
