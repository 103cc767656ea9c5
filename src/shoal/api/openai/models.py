"""GET /v1/models: the models this node serves, then catalogue models it could load.

Each entry's `loaded` (an extension) says where the model is loaded in the cluster: per
instance its serving node, memory held, pinned, keep-alive expiry and queue depth."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from shoal.api.model_list import listed_models, placements

router = APIRouter()


def _card(model_id: str, created: int, **extra: Any) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "shoal", **extra}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = request.app.state
    where = placements(state)
    data = [_card(model.id, state.started_at, state=model.state,
                  max_model_len=model.max_model_len, loaded=where.get(model.id, []))
            for model in listed_models(state)]
    return {"object": "list", "data": data}
