"""GET /v1/models: the models this node serves, then catalogue models it could load."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

router = APIRouter()


def _card(model_id: str, created: int, **extra: Any) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "shoal", **extra}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = request.app.state
    created = state.started_at
    data = []
    for supervisor in state.router.supervisors:
        info = supervisor.model_info
        data.append(_card(supervisor.model_id, created, state=supervisor.state,
                          max_model_len=info.max_model_len if info else None))
    served = {entry["id"] for entry in data}
    for entry in state.list_available():
        if entry.available and entry.id not in served:
            data.append(_card(entry.id, created, state="available",
                              max_model_len=entry.context_length))
    return {"object": "list", "data": data}
