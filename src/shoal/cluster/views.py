"""How an instance reads in GET /cluster, GET /instances and `shoal ps`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shoal.cluster.instances import Instance
from shoal.cluster.node_budget import rank_bytes
from shoal.cluster.state import ClusterState
from shoal.cluster.telemetry import NodeReading
from shoal.ids import NodeId


def describe_instance(state: ClusterState, instance: Instance,
                      readings: Mapping[NodeId, NodeReading] | None = None) -> dict[str, Any]:
    """An instance as GET /cluster, /instances and shoal ps show it: its ranks with what each
    holds, and from its serving node's latest reading its keep-alive expiry and queue."""
    server = (readings or {}).get(instance.ranks[0].node_id)
    ranks = []
    for rank in instance.ranks:
        held = rank_bytes(state, instance, rank.node_id)
        status = state.runners.get(rank.runner_id)
        experts = rank.experts
        ranks.append({"node_id": rank.node_id, "rank": rank.rank, "layers": list(rank.layers),
                      "experts": list(experts) if experts is not None else None,
                      "phase": status.phase if status else None,
                      "memory_bytes": held.bytes if held else None,
                      "measured": held.measured if held else False})
    return {"instance_id": instance.instance_id, "model": instance.model,
            "sharding": instance.sharding, "backend": instance.request.backend,
            "on_demand": instance.request.on_demand,
            "keep_alive_s": instance.request.keep_alive_s, "pinned": instance.request.pinned,
            "memory_bytes": sum(r["memory_bytes"] or 0 for r in ranks),
            "expires_at": server.expiries.get(instance.instance_id) if server else None,
            "queue_depth": server.queue_depths.get(instance.model, 0) if server else 0,
            "ranks": ranks, "status": state.instance_status(instance.instance_id)}
