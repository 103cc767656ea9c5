"""W3C trace context on every HTTP request: the `traceparent` header is honoured (its trace
id kept, a new span id made for this node's work) or a fresh trace begins; every response,
streamed or not, carries this node's `traceparent`. A generation's own spans name the
server span as their parent (admission.admitted copies it into the internal request), and
the server span itself is recorded once the response has been sent.
"""

from __future__ import annotations

import time

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.tracing.spans import SpanBuffer
from shoal.tracing.steps import RequestTrace
from shoal.tracing.traceparent import HEADER, ServerSpan, server_span

STATE_KEY = "trace"


def request_span(state: dict) -> ServerSpan | None:
    """The server span TraceContext made for the request whose scope state this is."""
    return state.get(STATE_KEY)


class TraceContext:
    """ASGI middleware: a ServerSpan in scope["state"]["trace"], traceparent on the response,
    and for a request that ran a model (admitted: it has a request id) the server span in
    the node's span buffer."""

    def __init__(self, app: ASGIApp, spans: SpanBuffer) -> None:
        self.app = app
        self.spans = spans

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        header = next((value.decode("latin-1") for name, value in scope.get("headers", ())
                       if name == HEADER.encode()), None)
        span = state[STATE_KEY] = server_span(header)
        start_ns = time.time_ns()
        status: list[int] = []
        recorded = False

        def record() -> None:
            nonlocal recorded
            if recorded or not state.get("request_id"):
                return
            recorded = True
            route = getattr(scope.get("route"), "path", None) or scope["path"]
            self.spans.record(RequestTrace(span.trace_id, span.parent_id),
                              f"{scope['method']} {route}", start_ns, args={
                                  "request_id": state["request_id"],
                                  "model": state.get("model"),
                                  "status": status[0] if status else None},
                              span_id=span.span_id)

        async def send_with_traceparent(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = span.header
                status.append(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                record()  # before the last bytes go: a client may ask for the trace next
            await send(message)

        try:
            await self.app(scope, receive, send_with_traceparent)
        finally:
            record()  # the response never finished (an error, a client gone)
