"""Ollama's error body: {"error": "message"}, in a JSON response or as an NDJSON line."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from shoal.api.errors import APIError

# Ollama answers a full queue with 503 ("server busy"), not 429.
_STATUS_BY_CODE = {"overloaded": 503}


def error_body(error: APIError) -> dict[str, str]:
    return {"error": error.described()}


def render(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=_STATUS_BY_CODE.get(error.code or "",
                                                                           error.status),
                        headers=error.headers)
