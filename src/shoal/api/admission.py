"""Who asked and how urgently: a request's priority and client id, in every dialect.

A body may carry the extension fields x_priority (an integer, 0 most urgent .. 9 least,
default 5) and x_client_id (a string); without them the headers X-Shoal-Priority and
X-Shoal-Client are read. A body field wins over its header. Both go to the router (queue
order, per-client caps) and never reach the model.

x_speculative ("off", "ngram" or "draft") chooses speculative decoding for one generation
request; without it the model's own --speculative setting applies.

x_session_id (a string of 1..256 characters) names a conversation: its turns go to the
instance that served it last while that instance lives, where its prefix KV is.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from shoal.api.errors import APIError, invalid_parameter
from shoal.api.requests import record_model, record_request_id
from shoal.api.trace_context import request_span
from shoal.engine.speculation.config import REQUEST_CHOICES as SPECULATIVE_CHOICES
from shoal.protocol import EmbeddingRequest, GenerationRequest, ImageRequest, TraceRef

PRIORITY_HEADER = "X-Shoal-Priority"
CLIENT_HEADER = "X-Shoal-Client"
MOST_URGENT, LEAST_URGENT = 0, 9
DEFAULT_PRIORITY = 5
MAX_CLIENT_ID_LENGTH = 128
MAX_SESSION_ID_LENGTH = 256
_HEADER_INTEGER = re.compile(r"[+-]?[0-9]+")

InternalRequest = TypeVar("InternalRequest", GenerationRequest, EmbeddingRequest, ImageRequest)


class AdmissionFields(BaseModel):
    """The body fields every dialect's request accepts. Typed Any so that "3" or 2.5 is
    refused with admission's message instead of being coerced by pydantic."""

    x_priority: Any = None
    x_client_id: Any = None
    x_speculative: Any = None
    x_session_id: Any = None


def admission_fields(http_request: Request, x_priority: Any, x_client_id: Any
                     ) -> dict[str, Any]:
    """{"priority", "client_id"} from the body values, else the headers; APIError(400) naming
    the field or header for a bad value."""
    headers = http_request.headers
    return {"priority": _priority(x_priority, headers.get(PRIORITY_HEADER)),
            "client_id": _client_id(x_client_id, headers.get(CLIENT_HEADER))}


def admitted(internal: InternalRequest, http_request: Request, body: AdmissionFields
             ) -> InternalRequest:
    """internal, carrying the priority and client id the body (or the headers) asked for,
    and the request's trace; its id becomes the response's x-request-id."""
    record_request_id(http_request, internal.request_id)
    record_model(http_request, internal.model)
    update = admission_fields(http_request, body.x_priority, body.x_client_id)
    if body.x_session_id is not None:
        session = _session_id(body.x_session_id)
        if isinstance(internal, GenerationRequest):  # an embedding keeps no KV
            update["session_id"] = session
    if body.x_speculative is not None:
        choice = _speculative(body.x_speculative)
        if isinstance(internal, GenerationRequest):  # embeddings have nothing to guess
            update["sampling"] = dataclasses.replace(internal.sampling, speculative=choice)
    span = request_span(http_request.scope.get("state", {}))
    if span is not None:
        update["trace"] = TraceRef(trace_id=span.trace_id, span_id=span.span_id)
    return internal.model_copy(update=update)


def _session_id(value: Any) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_SESSION_ID_LENGTH:
        raise invalid_parameter("x_session_id", "x_session_id must be a non-empty string of "
                                f"at most {MAX_SESSION_ID_LENGTH} characters, not "
                                f"{json.dumps(value, default=repr)[:80]}")
    return value


def _speculative(value: Any) -> str:
    if value not in SPECULATIVE_CHOICES:
        raise invalid_parameter("x_speculative", "x_speculative must be one of "
                                f"{', '.join(map(json.dumps, SPECULATIVE_CHOICES))}, not "
                                f"{json.dumps(value, default=repr)}")
    return value


def _priority(body_value: Any, header_value: str | None) -> int:
    if body_value is not None:
        # bool is an int subclass; true is not a priority
        if isinstance(body_value, bool) or not isinstance(body_value, int) \
                or not MOST_URGENT <= body_value <= LEAST_URGENT:
            raise _bad_priority("x_priority", body_value)
        return body_value
    if header_value is None:
        return DEFAULT_PRIORITY
    text = header_value.strip()
    if not _HEADER_INTEGER.fullmatch(text) or not MOST_URGENT <= int(text) <= LEAST_URGENT:
        raise _bad_priority(PRIORITY_HEADER, header_value)
    return int(text)


def _bad_priority(name: str, value: Any) -> APIError:
    # JSON spelling, so a client reads back what it sent: true, "3", 2.5
    return invalid_parameter(name, f"{name} must be an integer from {MOST_URGENT} (most "
                                   f"urgent) to {LEAST_URGENT} (least), not "
                                   f"{json.dumps(value, default=repr)}")


def _client_id(body_value: Any, header_value: str | None) -> str | None:
    name, value = ("x_client_id", body_value) if body_value is not None \
        else (CLIENT_HEADER, header_value)
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_CLIENT_ID_LENGTH:
        raise invalid_parameter(name, f"{name} must be a non-empty string of at most "
                                      f"{MAX_CLIENT_ID_LENGTH} characters")
    return value
