"""What each node's models hold against its memory budget, as the cluster state tells it.

Every node reports a memory budget (--memory-budget, or by default what placement reckons
it can use: usable memory plus what its own runners hold) and, optionally, how many models
it may hold (--max-loaded-models). Every instance with a rank on a node counts against that
node's budget: what the rank measured after it loaded (RunnerStatus.memory_bytes: resident
memory plus the KV blocks it was granted but has not touched yet), and placement's estimate
until then. A runner's KV grows only by grants the node checks here first (has_room_for).
A node whose accelerators hold models (llama-server built for a GPU) has a second budget for
them: such a model counts its measured buffers there (RunnerStatus.device_bytes), or, until
it reports, as much of its estimate as the accelerators have room for. Counting from the state, not from the next memory reading, means two placements
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
class Accelerators:
    """A node's accelerator memory (its GPUs') as models may use it: what they may hold
    there in all (NodeReading.device_budget), and the backends that keep models there."""

    budget: int
    backends: frozenset[str]

    @classmethod
    def of(cls, reading: NodeReading | None) -> Accelerators | None:
        if reading is None or reading.device_budget is None or not reading.device_backends:
            return None
        return cls(reading.device_budget, frozenset(reading.device_backends))

    def drive(self, backend: str) -> bool:
        return backend in self.backends


@dataclass(frozen=True)
class Holding:
    """One instance's share of a node's memory: RAM, and accelerator memory."""

    instance: Instance
    bytes: int  # RAM
    measured: bool  # False: placement's estimate (the rank has not reported after loading)
    device_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.bytes + self.device_bytes


def rank_bytes(state: ClusterState, instance: Instance, node_id: NodeId,
               policy: PlacementPolicy = DEFAULT_POLICY) -> Holding | None:
    """What instance's rank on node_id holds (measured) or will hold (estimated), all of
    it counted as RAM (holdings() splits an estimate between accelerators and RAM)."""
    rank = instance.rank_on(node_id)
    if rank is None:
        return None
    status = state.runners.get(rank.runner_id)
    if status is not None and status.memory_bytes is not None:
        return Holding(instance, status.memory_bytes, True, status.device_bytes or 0)
    estimate = rank_needed_bytes(instance.facts, rank, policy)
    return Holding(instance, estimate, False)


def holdings(state: ClusterState, node_id: NodeId,
             policy: PlacementPolicy = DEFAULT_POLICY,
             devices: Accelerators | None = None) -> list[Holding]:
    """Every instance with a rank on node_id and what it counts there, largest first.

    With devices, an instance whose backend drives them and has not reported yet is
    expected where llama.cpp's offload puts it: on the accelerators while they have room
    (after what reported instances hold there), the rest in RAM."""
    found = [h for i in state.instances.values()
             if (h := rank_bytes(state, i, node_id, policy)) is not None]
    if devices is not None:
        device_left = devices.budget - sum(h.device_bytes for h in found if h.measured)
        for index, held in sorted(enumerate(found), key=lambda p: p[1].instance.instance_id):
            if held.measured or not devices.drive(held.instance.request.backend):
                continue
            on_device = min(held.bytes, max(0, device_left))
            device_left -= on_device
            found[index] = Holding(held.instance, held.bytes - on_device, False, on_device)
    return sorted(found, key=lambda h: (-h.total_bytes, h.instance.instance_id))


def held_bytes(state: ClusterState, node_id: NodeId,
               policy: PlacementPolicy = DEFAULT_POLICY,
               devices: Accelerators | None = None) -> int:
    """RAM the instances on node_id hold."""
    return sum(h.bytes for h in holdings(state, node_id, policy, devices))


def has_room_for(state: ClusterState, node_id: NodeId, budget: int, extra_bytes: int,
                 live: Mapping[str, int], policy: PlacementPolicy = DEFAULT_POLICY,
                 devices: Accelerators | None = None) -> bool:
    """Whether node_id's RAM budget holds extra_bytes more beside what its instances hold.
    live: instance id -> what its rank here holds now (the runner's latest report with
    every grant counted), which replaces the state's figure, a report or two behind."""
    held = sum(live.get(h.instance.instance_id, h.bytes)
               for h in holdings(state, node_id, policy, devices))
    return held + extra_bytes <= budget


def loaded_count(state: ClusterState, node_id: NodeId) -> int:
    return sum(1 for i in state.instances.values() if i.rank_on(node_id) is not None)


def node_capacity(reading: NodeReading, state: ClusterState,
                  policy: PlacementPolicy = DEFAULT_POLICY) -> NodeCapacity:
    """What placement may still give a node: its budgets (RAM, and its accelerators') less
    what its instances hold, and the model slots it has left. A node that reports no budget
    is placed on its live usable memory (its loaded models are already out of that
    reading)."""
    live = reading.capacity()
    if reading.memory_budget is None:
        return live
    devices = Accelerators.of(reading)
    held = holdings(state, reading.node_id, policy, devices)
    free = max(0, reading.memory_budget - sum(h.bytes for h in held))
    device_free = 0
    if devices is not None:
        device_free = max(0, devices.budget - sum(h.device_bytes for h in held))
    slots = None
    if reading.max_loaded_models is not None:
        slots = max(0, reading.max_loaded_models - loaded_count(state, reading.node_id))
    return NodeCapacity(node_id=reading.node_id, usable_bytes=free, free_slots=slots,
                        holds=live.holds, backends=live.backends, device_bytes=device_free,
                        device_backends=live.device_backends)


def node_capacities(readings: Sequence[NodeReading], state: ClusterState,
                    policy: PlacementPolicy = DEFAULT_POLICY) -> list[NodeCapacity]:
    return [node_capacity(r, state, policy) for r in readings]


def describe_holdings(held: Sequence[Holding], limit: int = 4) -> str:
    """'m1 (0.52 GiB), m2 (0.31 GiB)' for an error that says what holds the memory."""
    if not held:
        return "nothing"
    parts = [f"{h.instance.model} ({gib(h.total_bytes)})" for h in held[:limit]]
    if len(held) > limit:
        parts.append(f"{len(held) - limit} more")
    return ", ".join(parts)

