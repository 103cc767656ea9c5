"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}.

Every failure the API reports goes through here, so status codes stay consistent:
bad input 400, unknown model 404, overload 429, unavailable 503, never a 500 for bad input.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shoal.protocol import ErrorChunk

# ErrorChunk.code -> (HTTP status, OpenAI error type)
STATUS_BY_CODE: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),
    "model_not_found": (404, "invalid_request_error"),
    "overloaded": (429, "rate_limit_error"),
    "unavailable": (503, "service_unavailable"),
    "runner_crashed": (503, "service_unavailable"),
    "timeout": (504, "timeout"),
    "internal": (500, "internal_error"),
}


class APIError(Exception):
    """Raised by routes and adapters; rendered as an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type

    @classmethod
    def from_chunk(cls, chunk: ErrorChunk) -> APIError:
        status, error_type = STATUS_BY_CODE.get(chunk.code, (500, "internal_error"))
        return cls(status, chunk.message, param=chunk.param, code=chunk.code,
                   error_type=error_type)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid_parameter(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_parameter")


def _validation_error(errors: list[dict[str, Any]]) -> APIError:
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part not in ("body",)]
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {message}",
                        code="invalid_json")
    where = f" ({param})" if param else ""
    return APIError(400, f"invalid value{where}: {message}", param=param,
                    code="invalid_parameter")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_request: Request,
                                  error: RequestValidationError) -> JSONResponse:
        return _validation_error(list(error.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return APIError(error.status_code, str(error.detail), code=code).response()
