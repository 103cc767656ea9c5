"""POST /api/embed and the older POST /api/embeddings (Ollama's embedding endpoints).

/api/embed: {"model", "input": string | [string], "truncate": true, "keep_alive", "options",
"dimensions"} -> {"model", "embeddings", "total_duration", "load_duration",
"prompt_eval_count"} (durations in nanoseconds). With truncate (Ollama's default) inputs
longer than the model's context are cut; with "truncate": false they are a 400. An empty
input only loads the model and returns no embeddings.
/api/embeddings: {"model", "prompt"} -> {"embedding": [...]} (inputs cut to the context,
as that endpoint has no truncate switch); an empty prompt only loads the model.
Errors are Ollama's {"error": "..."} bodies (rendered by the /api/ error dialect).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from shoal.api.admission import AdmissionFields, admitted
from shoal.api.embedding import check_dimensions, check_input_count, run_embedding
from shoal.api.errors import invalid_parameter
from shoal.api.generation import CLIENT_CLOSED_REQUEST, ClientGone
from shoal.api.ollama.adapter import model_name, new_request_id
from shoal.api.ollama.options import keep_alive_seconds
from shoal.api.ollama.schemas import OllamaModel
from shoal.protocol import EmbeddingRequest

router = APIRouter()


class EmbedBody(OllamaModel, AdmissionFields):
    model: str = Field(min_length=1)
    input: str | list[str] | None = None
    truncate: bool = True
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = None
    dimensions: int | None = None


class EmbeddingsBody(OllamaModel, AdmissionFields):
    model: str = Field(min_length=1)
    prompt: str = ""
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = None


def _texts(raw: str | list[str] | None) -> tuple[str, ...]:
    if raw is None or raw == "":
        return ()
    texts = (raw,) if isinstance(raw, str) else tuple(raw)
    check_input_count(len(texts))
    if any(text == "" for text in texts):
        raise invalid_parameter("input", "input must not contain empty strings")
    return texts


@router.post("/api/embed")
async def embed(body: EmbedBody, request: Request) -> Response:
    started = time.monotonic_ns()
    if body.dimensions is not None and body.dimensions < 1:
        raise invalid_parameter("dimensions", "dimensions must be at least 1")
    internal = admitted(EmbeddingRequest(
        request_id=new_request_id(), model=model_name(body.model), texts=_texts(body.input),
        truncate=body.truncate, keep_alive_s=keep_alive_seconds(body.keep_alive)), request, body)
    router = request.app.state.router
    try:
        result = await run_embedding(request, router, internal)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    check_dimensions(body.dimensions, result)
    return JSONResponse({
        "model": router.canonical_id(internal.model),
        "embeddings": [list(vector) for vector in result.embeddings],
        "total_duration": time.monotonic_ns() - started,
        "load_duration": int(result.load_duration_s * 1e9),
        "prompt_eval_count": result.prompt_tokens})


@router.post("/api/embeddings")
async def embeddings(body: EmbeddingsBody, request: Request) -> Response:
    internal = admitted(EmbeddingRequest(
        request_id=new_request_id(), model=model_name(body.model), texts=_texts(body.prompt),
        truncate=True, keep_alive_s=keep_alive_seconds(body.keep_alive)), request, body)
    try:
        result = await run_embedding(request, request.app.state.router, internal)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse({"embedding": list(result.embeddings[0]) if result.embeddings else []})
