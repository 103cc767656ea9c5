"""A model pulled from Ollama's library brings a params layer (default options such as stop
or temperature) and may bring a system layer; requests for it get them as Ollama applies
them: the params under the request's own options, the system prompt when the request has
none. The template layer is not used: shoal renders chats with the GGUF's own template."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request

from shoal.api.ollama.adapter import model_name
from shoal.api.ollama.schemas import ChatRequest, GenerateRequest, MessageIn

Body = TypeVar("Body", ChatRequest, GenerateRequest)


def with_model_defaults(body: Body, request: Request) -> Body:
    puller = getattr(request.app.state, "puller", None)
    if puller is None or not isinstance(body.model, str):
        return body
    card = puller.card_of(model_name(body.model))
    params, system = card.get("params"), card.get("system")
    update: dict[str, Any] = {}
    if isinstance(params, dict) and params:
        update["options"] = {**params, **(body.options or {})}
    if isinstance(system, str) and system:
        if isinstance(body, ChatRequest):
            if body.messages and not any(m.role == "system" for m in body.messages):
                update["messages"] = [MessageIn(role="system", content=system),
                                      *body.messages]
        elif not body.system:
            update["system"] = system
    return body.model_copy(update=update) if update else body
