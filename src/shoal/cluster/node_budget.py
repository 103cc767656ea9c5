"""What each node's models hold against its memory budget, as the cluster state tells it.

Every node reports a memory budget (--memory-budget, or by default what placement reckons
it can use: usable memory plus what its own runners hold) and, optionally, how many models
it may hold (--max-loaded-models). Every instance with a rank on a node counts against that
node's budget: what the rank measured after it loaded (RunnerStatus.memory_bytes: resident
memory plus the KV blocks it was granted but has not touched yet), and placement's estimate
until then. A runner's KV grows only by grants the node checks here first (has_room_for). Counting from the state, not from the next memory reading, means two placements
made a moment apart never both take the same free bytes.

Pure functions: the master places with them and each node's pool evicts with them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shoal.cluster.instances import Instance
from shoal.cluster.placement import (
    DEFAULT_POLICY,
    NodeCapacity,
    PlacementPolicy,
    gib,
    rank_needed_bytes,
)
from shoal.cluster.state import ClusterState
from shoal.cluster.telemetry import NodeReading
from shoal.ids import NodeId


@dataclass(frozen=True)
class Holding:
    """One instance's share of a node's memory."""

    instance: Instance
    bytes: int
    measured: bool  # False: placement's estimate (the rank has not reported after loading)


def rank_bytes(state: ClusterState, instance: Instance, node_id: NodeId,
               policy: PlacementPolicy = DEFAULT_POLICY) -> Holding | None:
    """What instance's rank on node_id holds (measured) or will hold (estimated)."""
    rank = instance.rank_on(node_id)
    if rank is None:
        return None
    status = state.runners.get(rank.runner_id)
    if status is not None and status.memory_bytes is not None:
        return Holding(instance, status.memory_bytes, True)
    estimate = rank_needed_bytes(instance.facts, rank, policy)
    return Holding(instance, estimate, False)


def holdings(state: ClusterState, node_id: NodeId,
             policy: PlacementPolicy = DEFAULT_POLICY) -> list[Holding]:
    """Every instance with a rank on node_id and what it counts there, largest first."""
    out = [h for i in state.instances.values()
           if (h := rank_bytes(state, i, node_id, policy)) is not None]
    return sorted(out, key=lambda h: (-h.bytes, h.instance.instance_id))


def held_bytes(state: ClusterState, node_id: NodeId,
               policy: PlacementPolicy = DEFAULT_POLICY) -> int:
    return sum(h.bytes for h in holdings(state, node_id, policy))


def has_room_for(state: ClusterState, node_id: NodeId, budget: int, extra_bytes: int,
                 live: Mapping[str, int], policy: PlacementPolicy = DEFAULT_POLICY) -> bool:
    """Whether node_id's budget holds extra_bytes more beside what its instances hold.
    live: instance id -> what its rank here holds now (the runner's latest report with
    every grant counted), which replaces the state's figure, a report or two behind."""
    held = sum(live.get(h.instance.instance_id, h.bytes)
               for h in holdings(state, node_id, policy))
    return held + extra_bytes <= budget


def loaded_count(state: ClusterState, node_id: NodeId) -> int:
    return sum(1 for i in state.instances.values() if i.rank_on(node_id) is not None)


def node_capacity(reading: NodeReading, state: ClusterState,
                  policy: PlacementPolicy = DEFAULT_POLICY) -> NodeCapacity:
    """What placement may still give a node: its budget less what its instances hold, and
    the model slots it has left. A node that reports no budget is placed on its live usable
    memory (its loaded models are already out of that reading)."""
    if reading.memory_budget is None:
        return reading.capacity()
    free = max(0, reading.memory_budget - held_bytes(state, reading.node_id, policy))
    slots = None
    if reading.max_loaded_models is not None:
        slots = max(0, reading.max_loaded_models - loaded_count(state, reading.node_id))
    return NodeCapacity(node_id=reading.node_id, usable_bytes=free, free_slots=slots,
                        holds=reading.held_model_names(),
                        backends=reading.capacity().backends)


def node_capacities(readings: Sequence[NodeReading], state: ClusterState,
                    policy: PlacementPolicy = DEFAULT_POLICY) -> list[NodeCapacity]:
    return [node_capacity(r, state, policy) for r in readings]


def describe_holdings(held: Sequence[Holding], limit: int = 4) -> str:
    """'m1 (0.52 GiB), m2 (0.31 GiB)' for an error that says what holds the memory."""
    if not held:
        return "nothing"
    parts = [f"{h.instance.model} ({gib(h.bytes)})" for h in held[:limit]]
    if len(held) > limit:
        parts.append(f"{len(held) - limit} more")
    return ", ".join(parts)

