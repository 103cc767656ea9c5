"""Cluster administration: GET /cluster, instances (place, delete, preview), /state, /events.

Errors use the OpenAI error body like every non-dialect route: 400 for a placement that
cannot be made (the message says why), 404 for an unknown model or instance, 503 while
cluster information is still arriving.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shoal.api.errors import APIError, invalid_parameter
from shoal.backend_names import BackendName
from shoal.catalog.resolve import ModelNotFound, resolve_model
from shoal.cluster.backends import BackendChoiceError, choose_backend
from shoal.cluster.instances import PlacementRequest
from shoal.cluster.model_facts import model_facts_from_source
from shoal.cluster.service import ClusterNotReady, ClusterService, PlacementRefused
from shoal.cluster.views import describe_instance
from shoal.engine.config import ModelSource
from shoal.engine.errors import UnsupportedModel
from shoal.sharding import RequestedSharding

router = APIRouter()


class PlaceBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    sharding: RequestedSharding = "auto"
    min_nodes: int = Field(default=1, ge=1)
    excluded_nodes: list[str] = Field(default_factory=list)
    # int8 hidden states between pipeline ranks (fewer bytes on slow links; not exact)
    hidden_int8: bool = False
    # Never evicted to make room, never unloaded for idleness (DELETE removes it).
    pin: bool = False
    # What serves it (engine, llama-server); None: the node's choice (cluster/backends.py).
    backend: BackendName | None = None


def _cluster(request: Request) -> ClusterService:
    return request.app.state.cluster


async def _resolved(request: Request, name: str) -> ModelSource:
    """name's files on this node; remembered by its pool's names, so that a runner this
    node starts for the placed instance finds them by the model's id (a path's stem). A
    name this node already knows (the id of a model it was given by path, say) means what
    it meant before."""
    router = getattr(request.app.state, "router", None)
    names = getattr(getattr(router, "pool", None), "names", None)
    known = None if names is None else names.sources().get(names.canonical_id(name))
    if known is not None:
        return known
    source = await asyncio.to_thread(resolve_model, name)
    if names is not None:
        names.remember(name, source)
    return source


async def _placement_request(body: PlaceBody, request: Request) -> PlacementRequest:
    """The model resolved on this node and read (headers only) into a PlacementRequest."""
    try:
        source = await _resolved(request, body.model)
        facts = await asyncio.to_thread(model_facts_from_source, source)
    except ModelNotFound as error:
        raise APIError(404, str(error), param="model", code="model_not_found") from None
    except (UnsupportedModel, ValueError) as error:
        raise invalid_parameter("model", str(error)) from None
    if body.sharding == "expert" and not facts.n_experts:
        raise invalid_parameter("sharding", "expert sharding needs a mixture-of-experts model: "
                                f"{body.model!r} has no experts")
    placer = getattr(getattr(request.app.state, "router", None), "placer", None)
    assigned = body.backend or (placer.backend_of(source.model_id) if placer else None)
    try:
        backend = choose_backend(facts, source.format, assigned,
                                 _cluster(request).backends_running())
    except BackendChoiceError as error:
        raise invalid_parameter("backend", str(error)) from None
    cluster = getattr(request.app.state, "cluster", None)
    if cluster is not None:
        facts = cluster.with_measured_size(facts, source, backend)
    try:
        return PlacementRequest(facts=facts, sharding=body.sharding, min_nodes=body.min_nodes,
                                excluded_nodes=tuple(body.excluded_nodes),
                                hidden_int8=body.hidden_int8, pinned=body.pin,
                                backend=backend)
    except ValidationError as error:
        param = "backend" if backend != "engine" else "sharding"
        raise invalid_parameter(param, error.errors()[0]["msg"]) from None


@router.get("/cluster")
async def cluster(request: Request) -> dict[str, Any]:
    return _cluster(request).describe()


@router.get("/cluster/cards")
async def cluster_cards(request: Request) -> dict[str, Any]:
    """Every node's live capability card (cluster/cards.py)."""
    return {"cards": _cluster(request).capabilities.describe()}


@router.post("/instances", status_code=201)
async def place_instance(body: PlaceBody, request: Request) -> JSONResponse:
    service = _cluster(request)
    placement = await _placement_request(body, request)
    try:
        instance = await service.place(placement)
    except ClusterNotReady as error:
        raise APIError(503, str(error), code="unavailable",
                       error_type="service_unavailable") from None
    except PlacementRefused as error:
        raise APIError(400, str(error), param="model", code="placement_impossible") from None
    return JSONResponse(describe_instance(service.state, instance, service.readings()),
                        status_code=201)


@router.delete("/instances/{instance_id}")
async def delete_instance(instance_id: str, request: Request) -> dict[str, Any]:
    if not _cluster(request).delete(instance_id):
        raise APIError(404, f"no instance {instance_id!r} in the cluster", param="instance_id",
                       code="instance_not_found")
    return {"instance_id": instance_id, "deleted": True}


@router.get("/instances/previews")
async def instance_previews(request: Request,
                            model: str = Query(min_length=1)) -> dict[str, Any]:
    service = _cluster(request)
    placement = await _placement_request(PlaceBody(model=model), request)
    options = []
    for preview in service.previews(placement):
        shards = preview.placement.shards if preview.placement else ()
        options.append({"sharding": preview.sharding, "width": preview.width,
                        "fits": preview.placement is not None, "reason": preview.error,
                        "ranks": [{"node_id": s.node_id, "layers": [s.layer_start, s.layer_end],
                                   "experts": ([s.expert_start, s.expert_end]
                                               if s.expert_end else None),
                                   "needed_bytes": s.needed_bytes,
                                   "usable_bytes": s.usable_bytes} for s in shards]})
    return {"model": placement.model, "previews": options}


@router.get("/instances")
async def instances(request: Request) -> dict[str, Any]:
    service = _cluster(request)
    return {"instances": service.describe_instances()}


@router.get("/state")
async def state(request: Request) -> dict[str, Any]:
    service = _cluster(request)
    replica = service.plane.replica
    return {"session": replica.session, "master_id": replica.master,
            "state": service.state.model_dump(mode="json")}


@router.get("/events")
async def events(request: Request, since: int = Query(default=0, ge=0)) -> dict[str, Any]:
    """The events this node applied recently (debugging; at most the last 1,000)."""
    service = _cluster(request)
    recent = [e.model_dump(mode="json") for e in service.recent if e.idx >= since]
    return {"session": service.plane.replica.session, "events": recent}
