"""POST /v1/embeddings: OpenAI's embeddings endpoint over an embedding model.

input is a string, a list of strings, a list of token ids or a list of token-id lists
(used as given). encoding_format "base64" returns each vector as base64 of its
little-endian float32 bytes, as OpenAI does. Inputs longer than the model's context are
refused (400, code context_length_exceeded), never silently cut.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from shoal.api.admission import AdmissionFields, admitted
from shoal.api.embedding import check_dimensions, check_input_count, run_embedding
from shoal.api.errors import invalid_parameter
from shoal.api.generation import CLIENT_CLOSED_REQUEST, ClientGone
from shoal.api.ollama.options import keep_alive_seconds
from shoal.api.openai.schemas import OpenAIModel
from shoal.protocol import EmbeddingRequest

router = APIRouter()


class EmbeddingsBody(OpenAIModel, AdmissionFields):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    keep_alive: float | str | None = None  # extension, as Ollama's: seconds or "5m"


def to_internal(body: EmbeddingsBody, request_id: str) -> EmbeddingRequest:
    """The internal request; APIError(400) naming the parameter for a bad input."""
    raw = [body.input] if isinstance(body.input, str) else body.input
    if not raw:
        raise invalid_parameter("input", "input must not be empty")
    check_input_count(len(raw))
    if body.dimensions is not None and body.dimensions < 1:
        raise invalid_parameter("dimensions", "dimensions must be at least 1")
    common = {"request_id": request_id, "model": body.model,
              "keep_alive_s": keep_alive_seconds(body.keep_alive)}
    if isinstance(raw[0], str):
        if any(text == "" for text in raw):
            raise invalid_parameter("input", "input must not contain empty strings")
        return EmbeddingRequest(texts=tuple(raw), **common)
    if isinstance(raw[0], int):  # one token-id list
        return EmbeddingRequest(token_ids=(tuple(raw),), **common)
    if any(not ids for ids in raw):
        raise invalid_parameter("input", "input must not contain empty token lists")
    return EmbeddingRequest(token_ids=tuple(tuple(ids) for ids in raw), **common)


def _encode(vector: tuple[float, ...], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return list(vector)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingsBody, request: Request) -> Response:
    state = request.app.state
    internal = admitted(to_internal(body, f"embd-{uuid.uuid4().hex}"), request, body)
    try:
        result = await run_embedding(request, state.router, internal)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    check_dimensions(body.dimensions, result)
    data: list[dict[str, Any]] = [
        {"object": "embedding", "index": index,
         "embedding": _encode(vector, body.encoding_format)}
        for index, vector in enumerate(result.embeddings)]
    return JSONResponse({
        "object": "list", "data": data, "model": state.router.canonical_id(body.model),
        "usage": {"prompt_tokens": result.prompt_tokens,
                  "total_tokens": result.prompt_tokens}})
