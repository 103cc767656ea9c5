"""Requests by id: every response carries x-request-id, and a generation accepted by this
node can be ended with POST /v1/requests/{id}/cancel.

The id is the request's own (chatcmpl-..., msg_..., resp_..., the one its body reports),
recorded by admission.admitted(); a response with no generation behind it (a listing, an
error before admission) gets a fresh one, so a client can always quote one in a report.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.api.errors import APIError
from shoal.ids import new_request_id
from shoal.metrics import NodeMetrics

HEADER = "x-request-id"

router = APIRouter()


def record_request_id(http_request: Request, request_id: str) -> None:
    """The id the response's x-request-id header will carry."""
    http_request.state.request_id = request_id


def record_model(http_request: Request, model: str) -> None:
    """The model the request asked for, for the metrics' model label."""
    http_request.state.model = model


class RequestIds:
    """ASGI middleware: x-request-id on every HTTP response, and each answer counted in
    metrics.http_requests by route template, model (only for a success: a client's unknown
    names must not grow the label set) and status."""

    def __init__(self, app: ASGIApp, metrics: NodeMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers[HEADER] = state.get("request_id") or new_request_id()
                self._count(scope, state, message["status"])
            await send(message)

        await self.app(scope, receive, send_with_id)

    def _count(self, scope: Scope, state: dict[str, Any], status: int) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None) or "unmatched"
        model = state.get("model") if status < 400 else None
        self.metrics.http_requests.labels(path, model or "-", str(status)).inc()


@router.post("/v1/requests/{request_id}/cancel")
async def cancel_request(request_id: str, request: Request) -> dict[str, Any]:
    """End a generation or image request in flight that arrived at this node (queued,
    loading or generating); its stream ends with finish reason "abort" (or a "cancelled"
    error before it started, and for images)."""
    if not request.app.state.router.cancel(request_id):
        raise APIError(404, f"no request {request_id!r} is in flight on this node (a "
                            "request is cancelled at the node that accepted it)",
                       param="request_id", code="request_not_found")
    return {"id": request_id, "object": "request.cancellation", "cancelled": True}
