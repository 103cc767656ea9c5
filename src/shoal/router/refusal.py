"""The ErrorChunk for a request the router could not serve: an unknown model or task, a
model that does not do what was asked, or what the pool refuses (no turn, no runner)."""

from __future__ import annotations

from shoal.catalog.resolve import ModelNotFound
from shoal.pool import pool
from shoal.protocol import ErrorChunk
from shoal.router.ladders import UnknownTask


def refusal(request_id: str, error: BaseException) -> ErrorChunk:
    """The ErrorChunk for a request whose model could not be found, started or used, or
    that could not wait its turn; re-raises any other error."""
    if isinstance(error, (ModelNotFound, UnknownTask)):
        return ErrorChunk(request_id=request_id, code="model_not_found", message=str(error),
                          param="model")
    if isinstance(error, ValueError):  # WrongModelTask, an empty or malformed name
        return ErrorChunk(request_id=request_id, code="invalid_request", message=str(error),
                          param="model")
    return pool.refusal(request_id, error)
