"""Running one embedding request for an HTTP request, whatever the dialect."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from shoal.api.errors import APIError, invalid_parameter
from shoal.api.generation import until_disconnect
from shoal.protocol import EmbeddingRequest, EmbeddingResult

# Inputs per request (OpenAI's documented limit); bounds one request's memory and time.
MAX_INPUTS = 2048


def check_input_count(count: int, param: str = "input") -> None:
    if count > MAX_INPUTS:
        raise invalid_parameter(param, f"{param} has {count} items; at most {MAX_INPUTS} "
                                       f"can be embedded in one request")


async def run_embedding(http_request: Request, router: Any,
                        internal: EmbeddingRequest) -> EmbeddingResult:
    """The request's vectors; APIError for a refusal, ClientGone if the client left."""
    result = await until_disconnect(http_request, router.embed(internal))
    if result.kind == "error":
        raise APIError.from_chunk(result)
    if len(result.embeddings) != internal.num_inputs:
        raise APIError(500, f"the runner returned {len(result.embeddings)} vectors for "
                            f"{internal.num_inputs} inputs", code="internal",
                       error_type="internal_error")
    return result


def check_dimensions(requested: int | None, result: EmbeddingResult) -> None:
    """shoal returns the model's full vectors; any other size asked for is refused."""
    if requested is None or not result.embeddings:
        return
    actual = len(result.embeddings[0])
    if requested != actual:
        raise invalid_parameter("dimensions", f"this model produces {actual}-dimensional "
                                              f"embeddings; dimensions={requested} is not "
                                              f"supported (omit it or pass {actual})")
