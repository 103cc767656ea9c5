"""Anthropic's error body {"type": "error", "error": {"type", "message"}} and status codes."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from shoal.api.errors import APIError

# A full queue is Anthropic's "overloaded" (529), which its clients retry with backoff.
_STATUS_BY_CODE = {"overloaded": 529}
_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 529: "overloaded_error"}


def status_of(error: APIError) -> int:
    return _STATUS_BY_CODE.get(error.code or "", error.status)


def error_body(error: APIError) -> dict[str, Any]:
    status = status_of(error)
    default = "api_error" if status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": _TYPE_BY_STATUS.get(status, default),
                                       "message": error.described()}}


def render(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=status_of(error), headers=error.headers)
