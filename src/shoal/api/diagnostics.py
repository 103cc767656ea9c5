"""GET /v1/diagnostics/node and /v1/diagnostics/cluster: what `shoal diagnose` saves for a
bug report (node_diagnostics.py), secrets removed. Protected by API keys like every
route."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from shoal.api.errors import APIError

router = APIRouter()


def _diagnostics(request: Request) -> Any:
    diagnostics = getattr(request.app.state, "diagnostics", None)
    if diagnostics is None:
        raise APIError(503, "this node has no diagnostics to give (it runs without a "
                            "cluster service)", code="unavailable",
                       error_type="service_unavailable")
    return diagnostics


@router.get("/v1/diagnostics/node")
async def node_diagnostics(request: Request) -> dict[str, Any]:
    return await _diagnostics(request).node_report()


@router.get("/v1/diagnostics/cluster")
async def cluster_diagnostics(request: Request) -> dict[str, Any]:
    return await _diagnostics(request).cluster_report()
