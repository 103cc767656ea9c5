"""Room on this node for a model about to be placed: evict idle instances, or say why not.

The node's budget and slots are counted from the cluster state (cluster/node_budget.py),
the same way the master counts them when it places; which idle instances go is the pool's
eviction choice (pool/eviction.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shoal.backend_names import DEFAULT_BACKEND
from shoal.cluster.model_facts import ModelFacts
from shoal.cluster.node_budget import describe_holdings, holdings, loaded_count
from shoal.cluster.placement import bytes_to_find, gib, shard_bytes
from shoal.cluster.service import ClusterService
from shoal.pool.eviction import choose_victims
from shoal.pool.pool import ModelPool

# How long an eviction waits for the evicted runners to exit and free their memory.
EVICT_WAIT_S = 30.0


@dataclass(frozen=True)
class Room:
    """What this node can do for a model: fits now, fits after evictions, or why not."""

    needed: int
    budget: int | None
    victims: tuple[str, ...] = ()  # instance ids to evict first
    blocked: str | None = None  # why it cannot fit here yet (busy or pinned models)
    never: str | None = None  # why it can never fit here (larger than the budget)


def room_for(cluster: ClusterService, pool: ModelPool, facts: ModelFacts,
             busy_models: set[str], backend: str = DEFAULT_BACKEND) -> Room:
    """Whether facts' model, served by backend, fits on this node whole, and what to evict
    for it. A backend that drives this node's accelerators has their budget too, and an
    evicted model frees what it held in both."""
    policy = cluster.policy
    needed = shard_bytes(facts, facts.n_layers, 1, policy)
    budget, max_loaded = cluster.budget()
    if budget is None:
        return Room(needed=needed, budget=None)
    devices = cluster.accelerators()
    state, here = cluster.state, cluster.node_id
    held = holdings(state, here, policy, devices)
    free = budget - sum(h.bytes for h in held)
    counted = {h.instance.instance_id: h.bytes for h in held}
    if devices is not None and devices.drive(backend):
        budget += devices.budget
        free += devices.budget - sum(h.device_bytes for h in held)
        counted = {h.instance.instance_id: h.total_bytes for h in held}
    # An estimate a little over the room is tried: the runner's pre-load guard decides.
    to_find = bytes_to_find(facts, needed, whole=True)
    if to_find > budget:
        return Room(needed=needed, budget=budget, never=(
            f"model {facts.model!r} needs about {gib(needed)} but this node's memory budget "
            f"is {gib(budget)}"))
    slots = 0
    if max_loaded is not None:
        slots = max(0, loaded_count(state, here) + 1 - max_loaded)
    served_here = [h for h in held if h.instance.ranks[0].node_id == here]
    residents = [pool.resident(h.instance.instance_id, h.instance.model,
                               counted[h.instance.instance_id], busy_models)
                 for h in served_here]
    victims = choose_victims(residents, to_find, free, slots)
    if victims is not None:
        return Room(needed=needed, budget=budget,
                    victims=tuple(v.instance_id for v in victims))
    limit = f", at most {max_loaded} model(s)" if max_loaded is not None else ""
    why = (f"model {facts.model!r} needs about {gib(needed)}; this node's memory budget is "
           f"{gib(budget)}{limit}, and {describe_holdings(held)} hold {gib(budget - free)}")
    idle_later = [dataclasses.replace(r, busy=False) for r in residents]
    if choose_victims(idle_later, to_find, free, slots) is None:
        # Even with every request finished it would not fit: pinned models (or ranks served
        # from other nodes) hold the rest. Waiting cannot help.
        return Room(needed=needed, budget=budget,
                    never=f"{why}; pinned models and ranks of instances served from other "
                          f"nodes are never evicted")
    return Room(needed=needed, budget=budget,
                blocked=f"{why}, and the ones that could make room are in use")


async def evict(cluster: ClusterService, pool: ModelPool, room: Room, model: str) -> None:
    """Unload room's victims and wait until they are out of the state and their runners
    have exited (bounded)."""
    for instance_id in room.victims:
        pool.evict(instance_id, f"evicted to make room for {model!r}")
    await cluster.wait_for(lambda state: all(i not in state.instances for i in room.victims),
                           EVICT_WAIT_S)
    await pool.registry.drain(EVICT_WAIT_S)
