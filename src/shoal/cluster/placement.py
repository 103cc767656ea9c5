"""Placement: which nodes hold which part of a model. Pure; the master turns the result into
an InstanceCreated event.

Memory model, per rank: its share of the weight bytes x an engine overhead factor, plus a KV
reservation for `kv_reservation_tokens` tokens of its layers and KV heads (the runner's first
KV grant), plus a fixed floor for the runner process; for a whole copy of a model that
loaded before, what it held then (ModelFacts.measured_bytes). It must fit the node's usable
memory, an estimate within ESTIMATE_TOLERANCE.

  single    one node holds everything; the node with the most usable memory wins.
  pipeline  w nodes, layers split in proportion to usable memory (each at least one layer).
  tensor    w nodes, every layer split across them: whole KV-head groups as evenly as they
            go (uneven when the group count does not divide), or, with fewer KV heads than
            nodes, a replicated KV head whose q heads split equally; MLP columns near-equally.
  expert    w nodes (a mixture-of-experts model), each holding every layer whole but for the
            routed experts, of which each holds a contiguous range, in proportion to the
            memory its node has left for them once the replicated part is counted.
  auto      single if it fits, else the narrowest width at which something fits: expert
            sharding there when the model has experts and it fits (it decodes and prefills
            faster than a pipeline of the same width: README, "Across nodes"), else a
            pipeline.
Explicit pipeline / tensor try widths from min_nodes up; a width of 1 is reported as single.
Wider attempts use the w nodes with the most usable memory. Nodes holding the model's files
(telemetry lists them) come first wherever the model fits on them: any other node must fetch
the files before it loads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.backend_names import DEFAULT_BACKEND
from shoal.cluster.instances import Instance, PlacementRequest, Rank, Rendezvous

# The memory model is placement's vocabulary: its callers take it from here too.
from shoal.cluster.memory_model import (  # noqa: F401
    DEFAULT_POLICY,
    ESTIMATE_OVERHEAD_FACTOR,
    ESTIMATE_TOLERANCE,
    PlacementPolicy,
    bytes_to_find,
    kv_heads_per_rank,
    rank_needed_bytes,
    shard_bytes,
    tensor_share,
)
from shoal.cluster.model_facts import ModelFacts
from shoal.ids import InstanceId, NodeId, runner_id_for
from shoal.sharding import MULTI_RANK_SHARDINGS, Sharding

GIB = 2**30
# System RAM models may use at most; the rest stays with the OS and other processes.
RAM_USABLE_FRACTION = 0.9
# Accelerator memory a backend may use at most (the driver and fragmentation take the rest).
DEVICE_USABLE_FRACTION = 0.95
# How far a rank's share may exceed live usable memory at load before the worker refuses.
LOAD_FIT_TOLERANCE = 0.10


def usable_ram(memory_total: int, memory_available: int) -> int:
    return max(0, min(memory_available, int(memory_total * RAM_USABLE_FRACTION)))


def usable_device(device_total: int, device_available: int) -> int:
    return max(0, min(device_available, int(device_total * DEVICE_USABLE_FRACTION)))


@dataclass(frozen=True)
class NodeCapacity:
    """One node's memory as telemetry last reported it, reduced to what placement may use.

    usable_bytes is RAM, where shoal's engine keeps a model. A backend that drives the
    node's accelerators (device_backends: llama-server built for CUDA or Metal, say) keeps
    what fits there in device_bytes and the rest in RAM, as llama.cpp's offload does:
    for_backend() gives the view placement uses for a model of that backend."""

    node_id: NodeId
    usable_bytes: int
    # Models it may still load (--max-loaded-models less those it holds); None: no limit.
    free_slots: int | None = None
    # Names (lower case) of the models whose files are on its disk: placed there first.
    holds: frozenset[str] = frozenset()
    # The backends it runs: a model goes only where its backend does (every node runs
    # shoal's engine).
    backends: frozenset[str] = frozenset({DEFAULT_BACKEND})
    # Accelerator memory free for the backends that drive it.
    device_bytes: int = 0
    device_backends: frozenset[str] = frozenset()

    def holds_model(self, model: str) -> bool:
        return model.lower() in self.holds

    @property
    def has_slot(self) -> bool:
        return self.free_slots is None or self.free_slots > 0

    def for_backend(self, backend: str) -> NodeCapacity:
        """The room a model served by backend has here: RAM, plus the accelerators'
        memory when backend drives them."""
        if backend not in self.device_backends:
            return self
        return dataclasses.replace(self, usable_bytes=self.usable_bytes + self.device_bytes)


@dataclass(frozen=True)
class ShardPlan:
    node_id: NodeId
    layer_start: int
    layer_end: int
    tp_rank: int
    tp_size: int
    needed_bytes: int
    usable_bytes: int
    expert_start: int = 0  # an expert rank's experts [start, end); (0, 0) otherwise
    expert_end: int = 0


@dataclass(frozen=True)
class Placement:
    request: PlacementRequest
    sharding: Sharding
    shards: tuple[ShardPlan, ...]

    @property
    def width(self) -> int:
        return len(self.shards)

    def to_instance(self, instance_id: InstanceId, rendezvous: Rendezvous | None = None,
                    attempt: int = 0) -> Instance:
        """The instance this placement describes; rendezvous is required for several ranks."""
        world = len(self.shards)
        ranks = tuple(
            Rank(runner_id=runner_id_for(instance_id, index), node_id=shard.node_id, rank=index,
                 world_size=world, layer_start=shard.layer_start, layer_end=shard.layer_end,
                 tp_rank=shard.tp_rank, tp_size=shard.tp_size, expert_start=shard.expert_start,
                 expert_end=shard.expert_end)
            for index, shard in enumerate(self.shards))
        return Instance(instance_id=instance_id, request=self.request, sharding=self.sharding,
                        ranks=ranks, rendezvous=rendezvous if world > 1 else None,
                        attempt=attempt)


@dataclass(frozen=True)
class PlacementError:
    """Why a request cannot be placed. pending: node memory has not been reported yet, so
    retrying shortly may succeed (the API answers 503, not 400)."""

    reason: str
    pending: bool = False


@dataclass(frozen=True)
class PlacementPreview:
    sharding: Sharding
    width: int
    placement: Placement | None
    error: str | None


def place(request: PlacementRequest, nodes: Sequence[NodeCapacity],
          policy: PlacementPolicy = DEFAULT_POLICY) -> Placement | PlacementError:
    """The narrowest placement that fits, honouring sharding, min_nodes and excluded_nodes."""
    runs = [n.for_backend(request.backend) for n in nodes if request.backend in n.backends]
    if nodes and not runs:
        return PlacementError(f"cannot place model {request.model!r}: no node runs "
                              f"{request.backend}")
    candidates = _candidates(runs, request.excluded_nodes)
    if isinstance(candidates, PlacementError):
        return candidates
    if request.min_nodes > len(candidates):
        return PlacementError(f"min_nodes is {request.min_nodes} but only {len(candidates)} "
                              f"node(s) are available{_excluded_note(request)}")
    failures: dict[Sharding, str] = {}
    for sharding, width in _attempts(request, len(candidates)):
        result = place_exact(request, candidates, sharding, width, policy)
        if isinstance(result, Placement):
            return result
        failures[sharding] = result.reason  # keeps the widest attempt's reason per sharding
    summary = "; ".join(f"{sharding}: {reason}" for sharding, reason in failures.items())
    return PlacementError(f"cannot place model {request.model!r}{_excluded_note(request)}: "
                          f"{summary}")


def place_exact(request: PlacementRequest, nodes: Sequence[NodeCapacity], sharding: Sharding,
                width: int, policy: PlacementPolicy = DEFAULT_POLICY,
                ) -> Placement | PlacementError:
    """One sharding at one width: on the nodes holding the model's files (then those with
    the most usable memory) when it fits there, else on the `width` nodes with the most
    usable memory.

    Width 1 is always "single": one node holding everything, whatever split was asked for;
    the request's preferred node when it fits there, else a node holding the files.
    request.excluded_nodes are skipped; request.sharding and min_nodes are not consulted.
    """
    skip = set(request.excluded_nodes)
    allowed = [n for n in nodes if n.node_id not in skip and n.has_slot]
    if width == 1:
        # The preferred node, then the nodes holding the model's files, then the rest.
        for node in _single_choices(allowed, request):
            here = _place_on(request, [node], "single", policy)
            if isinstance(here, Placement):
                return here
    memory_order = _by_memory(allowed)[:width]
    if width < 1 or len(memory_order) < width:
        full = [n.node_id for n in nodes if not n.has_slot and n.node_id not in skip]
        note = f" ({', '.join(full)} at --max-loaded-models)" if full else ""
        return PlacementError(f"needs {width} node(s), {len(memory_order)} available{note}")
    if sharding == "single" and width != 1:
        return PlacementError("single-node placement has width 1")
    if width == 1:
        sharding = "single"
    holders_first = _by_holding(allowed, request.model)[:width]
    if holders_first != memory_order:  # nodes that need not fetch the files, if they fit
        placed = _place_on(request, holders_first, sharding, policy)
        if isinstance(placed, Placement):
            return placed
    return _place_on(request, memory_order, sharding, policy)


def _place_on(request: PlacementRequest, chosen: Sequence[NodeCapacity], sharding: Sharding,
              policy: PlacementPolicy) -> Placement | PlacementError:
    """The model split over exactly these nodes, in this order (rank 0 first)."""
    width = len(chosen)
    facts = request.facts
    if sharding == "expert":
        return _place_experts(request, chosen, policy)
    if sharding == "pipeline":
        if width > facts.n_layers:
            return PlacementError(f"{width} nodes exceed the model's {facts.n_layers} layers")
        counts = split_layers(facts.n_layers, [n.usable_bytes for n in chosen])
        bounds = [sum(counts[:i]) for i in range(width + 1)]
        plans = [(node, bounds[i], bounds[i + 1], 0, 1) for i, node in enumerate(chosen)]
    else:
        reason = tensor_split_problem(facts, width) if sharding == "tensor" else None
        if reason is not None:
            return PlacementError(reason)
        plans = [(node, 0, facts.n_layers, i, width) for i, node in enumerate(chosen)]
    shards = []
    for node, start, end, tp_rank, tp_size in plans:
        needed = shard_bytes(facts, end - start, tp_size, policy)
        whole = end - start == facts.n_layers and tp_size == 1
        if bytes_to_find(facts, needed, whole) > node.usable_bytes:
            return PlacementError(
                f"over {width} node(s) node {node.node_id} needs {gib(needed)} for layers "
                f"[{start}, {end}) but has {gib(node.usable_bytes)} usable")
        shards.append(ShardPlan(node.node_id, start, end, tp_rank, tp_size, needed,
                                node.usable_bytes))
    return Placement(request=request, sharding=sharding, shards=tuple(shards))


def _place_experts(request: PlacementRequest, chosen: Sequence[NodeCapacity],
                   policy: PlacementPolicy) -> Placement | PlacementError:
    """Every layer on every node, the experts split in proportion to each node's room left
    once the replicated part (all but the experts, its KV and the floor) is counted."""
    facts, width = request.facts, len(chosen)
    reason = expert_split_problem(facts, width)
    if reason is not None:
        return PlacementError(reason)
    replicated = shard_bytes(facts, facts.n_layers, 1, policy, experts_held=0)
    rooms = [max(1, node.usable_bytes - replicated) for node in chosen]
    counts = split_layers(facts.n_experts, rooms)  # largest remainder, at least one each
    shards, start = [], 0
    for node, count in zip(chosen, counts):
        needed = shard_bytes(facts, facts.n_layers, 1, policy, experts_held=count)
        if bytes_to_find(facts, needed, whole=False) > node.usable_bytes:
            return PlacementError(
                f"over {width} node(s) node {node.node_id} needs {gib(needed)} for experts "
                f"[{start}, {start + count}) but has {gib(node.usable_bytes)} usable")
        shards.append(ShardPlan(node.node_id, 0, facts.n_layers, 0, 1, needed,
                                node.usable_bytes, start, start + count))
        start += count
    return Placement(request=request, sharding="expert", shards=tuple(shards))


def previews(request: PlacementRequest, nodes: Sequence[NodeCapacity],
             policy: PlacementPolicy = DEFAULT_POLICY) -> tuple[PlacementPreview, ...]:
    """Every sharding at every width the cluster allows, each placed or with its reason.

    request.sharding and min_nodes are ignored (a preview shows all options); excluded
    nodes and the backend are honoured.
    """
    candidates = _candidates([n.for_backend(request.backend) for n in nodes
                              if request.backend in n.backends],
                             request.excluded_nodes)
    if isinstance(candidates, PlacementError):
        return ()
    options: list[tuple[Sharding, int]] = [("single", 1)]
    for sharding in MULTI_RANK_SHARDINGS if request.backend == DEFAULT_BACKEND else ():
        if sharding == "expert" and not request.facts.n_experts:
            continue  # not an option for a dense model at all
        options += [(sharding, w) for w in range(2, len(candidates) + 1)]
    out = []
    for sharding, width in options:
        result = place_exact(request, candidates, sharding, width, policy)
        ok = isinstance(result, Placement)
        out.append(PlacementPreview(sharding, width, result if ok else None,
                                    None if ok else result.reason))
    return tuple(out)


def widen(request: PlacementRequest, refused_width: int,
          cluster_size: int) -> PlacementRequest | None:
    """The request one node wider than a refused placement; None when no wider one exists.

    Each retry is at least one node wider, so refusals end after at most cluster_size.
    An explicit single-node request cannot widen.
    """
    width = refused_width + 1
    if request.sharding == "single" or width > cluster_size:
        return None
    return request.model_copy(update={"min_nodes": max(width, request.min_nodes)})


def load_refusal(instance: Instance, node_id: NodeId, usable_bytes: int,
                 policy: PlacementPolicy = DEFAULT_POLICY,
                 tolerance: float = LOAD_FIT_TOLERANCE) -> str | None:
    """Why this node must refuse its rank at load time (live memory), or None if it fits.

    The master placed on gossiped readings; a live reading a little lower is jitter, not a
    reason to refuse, so the share may exceed usable memory by `tolerance` (the share is
    already padded by the overhead factor, the KV reservation and the floor).
    """
    rank = instance.rank_on(node_id)
    if rank is None:
        raise ValueError(f"instance {instance.instance_id} has no rank on node {node_id}")
    needed = rank_needed_bytes(instance.facts, rank, policy)
    whole = len(instance.ranks) == 1
    if bytes_to_find(instance.facts, needed, whole) <= usable_bytes * (1 + tolerance):
        return None
    return (f"node {node_id} needs {gib(needed)} for rank {rank.rank} of model "
            f"{instance.model!r} but has {gib(usable_bytes)} usable now")


def tensor_split_problem(facts: ModelFacts, width: int) -> str | None:
    """Why the model cannot be split over `width` tensor ranks, or None if it can."""
    if facts.n_experts:  # the engine refuses such a load (engine/models/moe.py)
        return ("a mixture-of-experts model cannot be split by tensor parallelism yet: "
                "split it by layers (pipeline) or by experts (expert)")
    group = facts.n_heads // facts.n_kv_heads
    if facts.n_kv_heads < width:
        sharing = width // facts.n_kv_heads
        if width % facts.n_kv_heads or group % sharing:
            return (f"{facts.n_heads} attention heads in {facts.n_kv_heads} KV groups cannot "
                    f"be split over {width} nodes")
    if facts.intermediate_size is not None and facts.intermediate_size < width:
        return f"MLP width {facts.intermediate_size} is narrower than {width} nodes"
    return None


def expert_split_problem(facts: ModelFacts, width: int) -> str | None:
    """Why the model cannot be split over `width` expert ranks, or None if it can."""
    if not facts.n_experts:
        return "expert sharding needs a mixture-of-experts model"
    if width > facts.n_experts:
        return f"{width} nodes exceed the model's {facts.n_experts} experts"
    return None


def split_layers(n_layers: int, weights: Sequence[int]) -> tuple[int, ...]:
    """n_layers split in proportion to weights (largest remainder), each share >= 1."""
    count = len(weights)
    if not 1 <= count <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers over {count} ranks")
    total = sum(weights)
    ideal = [n_layers * w / total if total > 0 else n_layers / count for w in weights]
    shares = [max(1, math.floor(x)) for x in ideal]
    while sum(shares) < n_layers:
        i = max(range(count), key=lambda k: (ideal[k] - shares[k], -k))
        shares[i] += 1
    while sum(shares) > n_layers:
        i = max((k for k in range(count) if shares[k] > 1),
                key=lambda k: (shares[k] - ideal[k], -k))
        shares[i] -= 1
    return tuple(shares)


# -- helpers ------------------------------------------------------------------------------


def _attempts(request: PlacementRequest, available: int) -> list[tuple[Sharding, int]]:
    low = request.min_nodes
    if request.sharding == "single" or request.backend != DEFAULT_BACKEND:
        return [("single", 1)]  # other backends serve a model whole
    if request.sharding in MULTI_RANK_SHARDINGS:
        return [(request.sharding, w) for w in range(low, available + 1)]
    single: list[tuple[Sharding, int]] = [("single", 1)] if low == 1 else []
    # At each width a mixture-of-experts model tries experts first (faster where both fit).
    splits: tuple[Sharding, ...] = ("expert", "pipeline") if request.facts.expert_bytes else \
        ("pipeline",)
    return single + [(sharding, w) for w in range(max(2, low), available + 1)
                     for sharding in splits]


def _candidates(nodes: Sequence[NodeCapacity],
                excluded: Sequence[NodeId]) -> list[NodeCapacity] | PlacementError:
    if not nodes:
        return PlacementError("no node has reported its memory yet", pending=True)
    skip = set(excluded)
    candidates = [n for n in nodes if n.node_id not in skip]
    if not candidates:
        return PlacementError(f"all {len(nodes)} node(s) are excluded")
    return _by_memory(candidates)


def _by_memory(nodes: Sequence[NodeCapacity]) -> list[NodeCapacity]:
    return sorted(nodes, key=lambda n: (-n.usable_bytes, n.node_id))


def _by_holding(nodes: Sequence[NodeCapacity], model: str) -> list[NodeCapacity]:
    """Nodes holding the model's files first, each group by memory."""
    return sorted(nodes, key=lambda n: (not n.holds_model(model), -n.usable_bytes, n.node_id))


def _single_choices(nodes: Sequence[NodeCapacity],
                    request: PlacementRequest) -> list[NodeCapacity]:
    """Where a single-rank instance is tried, in order: the request's preferred node, the
    nodes holding the model's files, then the one with the most memory."""
    preferred = [n for n in nodes if n.node_id == request.preferred_node]
    holders = [n for n in _by_holding(nodes, request.model)
               if n.holds_model(request.model) and n not in preferred]
    rest = [n for n in _by_memory(nodes)[:1] if n not in preferred and n not in holders]
    return preferred + holders + rest


def _excluded_note(request: PlacementRequest) -> str:
    if not request.excluded_nodes:
        return ""
    return f" (excluding {', '.join(request.excluded_nodes)})"


def gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB"
