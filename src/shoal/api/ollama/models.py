"""Ollama's model endpoints: GET /api/tags, GET /api/ps, POST /api/show, GET /api/version,
and the liveness answer GET / and HEAD / give clients other than browsers (api/dashboard).

/api/tags lists exactly what /v1/models lists (shoal.api.model_list). /api/ps lists the
models this node's pool runs (not other nodes' models, nor ranks of split instances); its
"size" is what each holds now: weights plus the KV cache in use and kept for the prefix
cache, as the runner last reported (the weight files' size until it has), split up in the
extension object "shoal".

Ollama's model "digest" is a content hash of its manifest; shoal has no manifests, so its
digest fingerprints the local weights (id, path, size, modification time) instead.
"""

from __future__ import annotations

import functools
import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from shoal.api.errors import APIError
from shoal.api.model_list import ListedModel, find_listed, listed_models, placements
from shoal.api.ollama.adapter import model_name
from shoal.api.ollama.schemas import ModelNameRequest
from shoal.catalog.cards import load_builtin_catalog
from shoal.catalog.resolve import find_card

router = APIRouter()

# The Ollama API version whose request and response shapes shoal follows; clients read it to
# decide which features (tools, structured outputs) they may use.
OLLAMA_API_VERSION = "0.12.0"


@functools.cache
def _builtin_catalog() -> tuple[Any, ...]:
    return load_builtin_catalog()  # package data: it cannot change while shoal runs


def _card(model_id: str) -> Any | None:
    """The catalogue card (family, parameters, quantization) of a model, if it has one."""
    return find_card(model_id, _builtin_catalog())


def _weights_path(model: ListedModel) -> Path | None:
    if model.entry is not None and model.entry.path is not None:
        return Path(model.entry.path)
    if model.supervisor is not None:
        return Path(model.supervisor.config.source.path)
    return None


def _size(path: Path | None) -> int:
    if path is None or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _parameter_size(parameters: int) -> str:
    if parameters >= 1_000_000_000:
        return f"{parameters / 1e9:.1f}B"
    return f"{parameters / 1e6:.0f}M" if parameters else ""


def details_json(model: ListedModel) -> dict[str, Any]:
    card = _card(model.id)
    family = card.family if card else ""
    weights_format = card.format if card else (
        model.supervisor.config.source.format if model.supervisor else "")
    return {"parent_model": "", "format": weights_format, "family": family,
            "families": [family] if family else None,
            "parameter_size": _parameter_size(card.parameters) if card else "",
            "quantization_level": card.quantization if card else ""}


def model_json(model: ListedModel) -> dict[str, Any]:
    """One model as /api/tags and /api/ps describe it."""
    path = _weights_path(model)
    entry = model.entry
    # A pulled model's size is all of its files (a split GGUF's parts, a checkpoint's).
    size = entry.size_bytes if getattr(entry, "source", "") == "store" else _size(path)
    modified = path.stat().st_mtime if path is not None and path.exists() else 0.0
    fingerprint = f"{model.id}\0{path}\0{size}\0{modified}".encode()
    return {"name": model.id, "model": model.id,
            "modified_at": datetime.fromtimestamp(modified, UTC).isoformat(),
            "size": size, "digest": hashlib.sha256(fingerprint).hexdigest(),
            "details": details_json(model)}


def _expires_at(supervisor: Any) -> str | None:
    """When the keep-alive unloads the model (epoch seconds set by the router); null while it
    is in use or kept loaded indefinitely."""
    if supervisor.expires_at is None:
        return None
    return datetime.fromtimestamp(supervisor.expires_at, UTC).isoformat()


def liveness() -> PlainTextResponse:
    """What Ollama answers on GET /; its clients and scripts probe for exactly this text."""
    return PlainTextResponse("Ollama is running")


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_API_VERSION}


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    return {"models": [model_json(model) for model in listed_models(request.app.state)]}


def running_json(model: ListedModel) -> dict[str, Any]:
    """One model with a local runner as /api/ps describes it."""
    supervisor = model.supervisor
    described = {**model_json(model), "expires_at": _expires_at(supervisor), "size_vram": 0,
                 "context_length": model.max_model_len}
    memory = supervisor.memory
    if memory is not None:
        device = memory.device_bytes or 0  # on a GPU: Ollama's size counts it, size_vram too
        if memory.footprint_bytes is not None:  # what the node counts it holding
            described["size"] = memory.footprint_bytes + device
        described["size_vram"] = device
        described["shoal"] = {"weights_bytes": memory.weights_bytes,
                              "kv_bytes_in_use": memory.kv_bytes_in_use,
                              "kv_bytes_cached": memory.kv_bytes_cached,
                              "kv_bytes_granted": memory.kv_bytes_granted,
                              "kv_bytes_capacity": memory.kv_bytes_capacity,
                              "rss_bytes": memory.rss_bytes,
                              "device_bytes": memory.device_bytes}
    return described


@router.get("/api/ps")
async def running(request: Request) -> dict[str, Any]:
    """Every loaded model: this node's runners with what each holds, then instances other
    nodes serve as the cluster state counts them. In a cluster, "shoal" also says which
    node, which instance, pinned and the serving node's queue for the model."""
    state = request.app.state
    listed = listed_models(state)
    models = [running_json(model) for model in listed
              if model.supervisor is not None and model.state not in ("stopped", "failed")]
    cluster = getattr(state, "cluster", None)
    if cluster is None:
        return {"models": models}
    by_id = {model.id: model for model in listed}
    here = {entry["model"]: entry for entry in models}
    for model_id, placed in placements(state).items():
        for place in placed:
            entry = here.pop(model_id, None) if place["node_id"] == cluster.node_id else None
            if entry is None:
                model = by_id.get(model_id) or ListedModel(id=model_id, state=place["status"],
                                                           max_model_len=None, entry=None,
                                                           supervisor=None)
                entry = _remote_json(model, place)
                models.append(entry)
            entry["shoal"] = {**entry.get("shoal", {}), **place}
    return {"models": models}


def _remote_json(model: ListedModel, place: dict[str, Any]) -> dict[str, Any]:
    """An instance served by another node, as the cluster state counts it."""
    expires = place["expires_at"]
    device = place.get("device_bytes") or 0
    return {**model_json(model), "size": place["memory_bytes"] + device, "size_vram": device,
            "expires_at": (None if expires is None
                           else datetime.fromtimestamp(expires, UTC).isoformat()),
            "context_length": model.max_model_len}


@router.post("/api/show")
async def show(body: ModelNameRequest, request: Request) -> dict[str, Any]:
    name = model_name(body.model_name)
    if not name:
        raise APIError(400, "model is required", param="model", code="invalid_parameter")
    model = find_listed(request.app.state, name)
    if model is None:
        raise APIError(404, f"model {name!r} not found", param="model",
                       code="model_not_found", error_type="invalid_request_error")
    card = _card(model.id)
    details = details_json(model)
    family = details["family"] or "unknown"
    info: dict[str, Any] = {"general.architecture": family}
    if card is not None:
        info["general.parameter_count"] = card.parameters
    if model.max_model_len:
        info[f"{family}.context_length"] = model.max_model_len
    kind = card.kind if card else "chat"
    described = model_json(model)
    pulled = getattr(model.entry, "card", None) or {}  # a model pulled from Ollama's library
    shown = {"modelfile": f"# served by shoal\nFROM {_weights_path(model) or model.id}\n",
             "parameters": parameters_text(pulled.get("params")),
             "template": pulled.get("template", ""), "details": details, "model_info": info,
             "capabilities": capabilities(model, kind),
             "modified_at": described["modified_at"]}
    if pulled.get("system"):
        shown["system"] = pulled["system"]
    return shown


def capabilities(model: ListedModel, kind: str) -> list[str]:
    """Ollama's capabilities: every chat model takes tools (shoal writes them into the
    prompt when its template has no place for them); "thinking" where the loaded model's
    chat format streams reasoning apart and "vision" where it takes images (both known
    once a runner has loaded it); an image model only draws."""
    info = getattr(model.supervisor, "model_info", None)
    if kind == "embedding" or (info is not None and info.task == "embed"):
        return ["embedding"]
    if kind == "image" or (info is not None and info.task == "image"):
        return ["image"]  # it draws (/v1/images/generations), it does not write
    found = ["completion"]
    if kind != "base":
        found.append("tools")
    if info is not None and info.reasons:
        found.append("thinking")
    if info is not None and info.takes_images:
        found.append("vision")
    return found


def parameters_text(params: Any) -> str:
    """Ollama's params layer as /api/show prints it: one "name value" line per value."""
    if not isinstance(params, dict):
        return ""
    lines = []
    for name, value in params.items():
        for item in value if isinstance(value, list) else [value]:
            lines.append(f"{name} {json.dumps(item) if isinstance(item, str) else item}")
    return "\n".join(lines)
