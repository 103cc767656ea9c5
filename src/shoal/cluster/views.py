"""How an instance and a node read in GET /cluster, GET /instances and `shoal ps`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shoal.cluster.instances import Instance
from shoal.cluster.node_budget import Accelerators, holdings, rank_bytes
from shoal.cluster.placement import PlacementPolicy
from shoal.cluster.state import ClusterState, NodeInfo
from shoal.cluster.telemetry import NodeReading
from shoal.ids import NodeId


def describe_node(state: ClusterState, info: NodeInfo, reading: NodeReading | None,
                  policy: PlacementPolicy) -> dict[str, Any]:
    """A node as GET /cluster shows it: its latest reading, its budgets and what its
    instances hold against them (RAM, and its accelerators' memory)."""
    devices = Accelerators.of(reading)
    held = holdings(state, info.node_id, policy, devices)
    return {
        "node_id": info.node_id, "name": info.name, "addresses": list(info.addresses),
        "memory_total": reading.memory_total if reading else None,
        "memory_available": reading.memory_available if reading else None,
        "memory_budget": reading.memory_budget if reading else None,
        "memory_held": sum(h.bytes for h in held),
        "gpus": [g.model_dump() for g in reading.gpus] if reading else [],
        "device_budget": reading.device_budget if reading else None,
        "device_held": sum(h.device_bytes for h in held) if devices else None,
        "max_loaded_models": reading.max_loaded_models if reading else None,
        "cpu_percent": reading.cpu_percent if reading else None,
        "cpu_count": reading.cpu_count if reading else None,
        "queue_depth": sum(reading.queue_depths.values()) if reading else 0,
        "backends": list(reading.backends) if reading else [],
        "backend_devices": ({k: list(v) for k, v in reading.backend_devices.items()}
                            if reading else {}),
        # The model files on its disk (placement prefers these nodes).
        "models": [{"model": m.model, "size": m.size, "files": len(m.files)}
                   for m in reading.models] if reading else [],
        "last_seen": reading.taken_at if reading else None}


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
                      "device_bytes": held.device_bytes if held else None,
                      "measured": held.measured if held else False})
    return {"instance_id": instance.instance_id, "model": instance.model,
            "sharding": instance.sharding, "backend": instance.request.backend,
            "on_demand": instance.request.on_demand,
            "keep_alive_s": instance.request.keep_alive_s, "pinned": instance.request.pinned,
            "memory_bytes": sum(r["memory_bytes"] or 0 for r in ranks),
            "device_bytes": sum(r["device_bytes"] or 0 for r in ranks),
            "expires_at": server.expiries.get(instance.instance_id) if server else None,
            "queue_depth": server.queue_depths.get(instance.model, 0) if server else 0,
            "ranks": ranks, "status": state.instance_status(instance.instance_id)}
