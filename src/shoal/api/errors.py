"""API errors, rendered in the dialect of the route that failed.

Every failure the API reports is an APIError, so status codes stay consistent: bad input 400,
unknown model 404, overload 429, unavailable 503, never a 500 for bad input. Routes under a
registered path prefix (Ollama's /api/, Anthropic's /v1/messages) render it in their own
dialect; everything else gets OpenAI's body {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from collections.abc import Callable
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
    # nginx's "client closed request": nobody but the canceller reads it.
    "cancelled": (499, "cancelled"),
    "internal": (500, "internal_error"),
}


class APIError(Exception):
    """Raised by routes and adapters; rendered as an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, error_type: str = "invalid_request_error",
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type
        self.retry_after_s = retry_after_s

    @classmethod
    def from_chunk(cls, chunk: ErrorChunk) -> APIError:
        status, error_type = STATUS_BY_CODE.get(chunk.code, (500, "internal_error"))
        return cls(status, chunk.message, param=chunk.param, code=chunk.code,
                   error_type=error_type, retry_after_s=chunk.retry_after_s)

    @property
    def headers(self) -> dict[str, str] | None:
        """Retry-After on an overload answer, in every dialect."""
        if self.retry_after_s is None:
            return None
        return {"Retry-After": str(self.retry_after_s)}

    def described(self) -> str:
        """The message, led by the parameter it blames when it does not name it already
        (for dialects whose error body has no field for the parameter)."""
        if self.status != 400 or not self.param or self.param in self.message:
            return self.message
        return f"{self.param}: {self.message}"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


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


ErrorRenderer = Callable[[APIError], JSONResponse]


def register_error_dialect(app: FastAPI, path_prefix: str, render: ErrorRenderer) -> None:
    """Render errors of requests whose path starts with path_prefix with render."""
    app.state.error_dialects.append((path_prefix, render))


def render_error(request: Request, error: APIError) -> JSONResponse:
    """error in the dialect of request's route."""
    for prefix, render in request.app.state.error_dialects:
        if request.url.path.startswith(prefix):
            return render(error)
    return error.response()


def install_error_handlers(app: FastAPI) -> None:
    app.state.error_dialects = []

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return render_error(request, error)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request,
                                  error: RequestValidationError) -> JSONResponse:
        return render_error(request, _validation_error(list(error.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return render_error(request, APIError(error.status_code, str(error.detail), code=code))
