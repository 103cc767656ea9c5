"""GET /v1/traces/{trace_id}: one request's trace from every node and runner of the cluster,
as Chrome trace JSON (tracing/chrome.py): open it in chrome://tracing or Perfetto.

The id is the one the request's traceparent named (or the one its response's traceparent
header gave). Nodes that do not answer within a bound are named in "otherData"; an id of
which no node holds a span is a 404.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from shoal.api.errors import APIError, invalid_parameter
from shoal.tracing.chrome import chrome_trace, count_spans
from shoal.tracing.traceparent import is_trace_id

router = APIRouter()


@router.get("/v1/traces/{trace_id}")
async def get_trace(trace_id: str, request: Request) -> JSONResponse:
    trace_id = trace_id.strip().lower()
    if not is_trace_id(trace_id):
        raise invalid_parameter("trace_id", "a trace id is 32 hexadecimal digits, not all "
                                            "zero (the second field of a traceparent header)")
    parts, missing = await _parts(request, trace_id)
    if not count_spans(parts):
        raise APIError(404, f"no node of the cluster holds spans of trace {trace_id} (spans "
                            "are kept in memory, the oldest dropped first)",
                       param="trace_id", code="trace_not_found")
    other: dict[str, Any] = {"trace_id": trace_id}
    if missing:
        other["nodes_without_answer"] = missing
    runners = {f"{part['node_id']}: {label}": reason for part in parts
               for label, reason in part.get("unanswered", {}).items()}
    if runners:
        other["runners_without_answer"] = runners
    return JSONResponse(chrome_trace(parts, other))


async def _parts(request: Request, trace_id: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    cluster = request.app.state.cluster
    if cluster is None:  # an app with no cluster (tests): the node process's spans only
        spans = request.app.state.spans.of(trace_id)
        part = {"node_id": "local", "name": "node",
                "processes": [{"label": "node", "spans": spans}] if spans else []}
        return [part], {}
    return await cluster.trace(trace_id)
