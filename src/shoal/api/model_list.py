"""The models a node offers, as every dialect lists them: served ones first (by this node, then
by other nodes of its cluster), then catalogue models whose weights are on this machine
(app.state.list_available)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ListedModel:
    id: str
    # the runner's state; an instance's status for a model served by another node;
    # "available" for a catalogue model not loaded
    state: str
    max_model_len: int | None
    entry: Any | None  # the catalogue entry (shoal.catalog.resolve.CatalogEntry), if any
    supervisor: Any | None  # the runner supervisor serving it, if any


def listed_models(state: Any) -> list[ListedModel]:
    """Every model to list, in /v1/models order; state is the FastAPI app's state."""
    available = [entry for entry in state.list_available() if entry.available]
    entries = {entry.id: entry for entry in available}
    listed = []
    for supervisor in state.router.supervisors:
        info = supervisor.model_info
        listed.append(ListedModel(id=supervisor.model_id, state=supervisor.state,
                                  max_model_len=info.max_model_len if info else None,
                                  entry=entries.get(supervisor.model_id),
                                  supervisor=supervisor))
    served = {model.id for model in listed}
    for model_id, status in _cluster_models(state).items():
        if model_id not in served:
            entry = entries.get(model_id)
            context = (entry.context_length or None) if entry else None  # 0: not known
            listed.append(ListedModel(id=model_id, state=status, max_model_len=context,
                                      entry=entry, supervisor=None))
            served.add(model_id)
    for entry in available:
        if entry.id not in served:
            listed.append(ListedModel(id=entry.id, state="available",
                                      max_model_len=entry.context_length or None, entry=entry,
                                      supervisor=None))
    return listed


def _cluster_models(state: Any) -> dict[str, str]:
    """Model id -> the best status of its instances in the cluster (ready first)."""
    cluster = getattr(state, "cluster", None)
    if cluster is None:
        return {}
    order = ("ready", "loading", "starting", "failed")
    best: dict[str, str] = {}
    for instance in cluster.state.instances.values():
        status = cluster.state.instance_status(instance.instance_id)
        current = best.get(instance.model)
        if current is None or order.index(status) < order.index(current):
            best[instance.model] = status
    return best


def find_listed(state: Any, name: str) -> ListedModel | None:
    """The listed model a client's name means: its id, a catalogue alias, or a name the
    router has already resolved."""
    key = state.router.canonical_id(name).lower()
    for model in listed_models(state):
        aliases = getattr(model.entry, "aliases", ())
        if key == model.id.lower() or key in (alias.lower() for alias in aliases):
            return model
    return None


def placements(state: Any) -> dict[str, list[dict[str, Any]]]:
    """Model id -> where it is loaded, one entry per instance: the serving node, memory held,
    pinned, keep-alive expiry (unix seconds) and that node's queue for it."""
    cluster = getattr(state, "cluster", None)
    if cluster is None:
        return {}
    out: dict[str, list[dict[str, Any]]] = {}
    for described in cluster.describe_instances():
        out.setdefault(described["model"], []).append({
            "node_id": described["ranks"][0]["node_id"],
            "nodes": [r["node_id"] for r in described["ranks"]],
            "instance_id": described["instance_id"], "status": described["status"],
            "memory_bytes": described["memory_bytes"],
            "device_bytes": described["device_bytes"], "pinned": described["pinned"],
            "expires_at": described["expires_at"], "queue_depth": described["queue_depth"]})
    return out
