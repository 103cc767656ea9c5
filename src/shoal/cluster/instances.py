"""Instances: one placed copy of a model, split into ranks across nodes.

A rank is one runner process on one node. Pipeline ranks each hold a contiguous, half-open
range of layers that keeps the original layer indices; tensor ranks hold every layer and a
1/tp_size slice of its heads and MLP columns; expert ranks hold every layer and a contiguous
range [expert_start, expert_end) of each mixture-of-experts layer's experts. A single-node
instance is one rank holding everything.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

from shoal.backend_names import DEFAULT_BACKEND, BackendName
from shoal.cluster.model_facts import ModelFacts
from shoal.ids import InstanceId, ModelId, NodeId, RunnerId
from shoal.sharding import RequestedSharding, Sharding


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Rank(Frozen):
    """One rank of an instance: which node runs it and which part of the model it holds."""

    runner_id: RunnerId
    node_id: NodeId
    rank: int
    world_size: int
    layer_start: int
    layer_end: int  # exclusive
    tp_rank: int = 0
    tp_size: int = 1
    # An expert rank's experts of each mixture-of-experts layer; (0, 0) for other shardings.
    expert_start: int = 0
    expert_end: int = 0

    @model_validator(mode="after")
    def _check(self) -> Rank:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"layer range [{self.layer_start}, {self.layer_end}) is empty "
                             "or negative")
        if self.expert_start < 0 or self.expert_end < self.expert_start:
            raise ValueError(f"expert range [{self.expert_start}, {self.expert_end}) is "
                             "negative")
        return self

    @property
    def layers(self) -> tuple[int, int]:
        return (self.layer_start, self.layer_end)

    @property
    def experts(self) -> tuple[int, int] | None:
        """The experts an expert rank holds; None for other shardings."""
        return (self.expert_start, self.expert_end) if self.expert_end else None


class Rendezvous(Frozen):
    """Where the ranks of a multi-rank instance meet to form their process group: rank 0's
    node address and a port the master picked for this placement."""

    host: str
    port: int

    @model_validator(mode="after")
    def _check(self) -> Rendezvous:
        if not self.host or not 0 < self.port < 65536:
            raise ValueError(f"invalid rendezvous {self.host}:{self.port}")
        return self


class PlacementRequest(Frozen):
    """What a client asks for: a model, how to split it, how wide, and which nodes to avoid."""

    facts: ModelFacts
    sharding: RequestedSharding = "auto"
    min_nodes: int = 1
    excluded_nodes: tuple[NodeId, ...] = ()
    # Pipeline ranks pass hidden states as int8 with a scale per token (a quarter of the
    # bytes of float32, for slow links; not exact).
    hidden_int8: bool = False
    # A single-rank instance goes on this node when it fits there (the node a request for
    # the model arrived at), else where placement would put it anyway.
    preferred_node: NodeId | None = None
    # How long the instance stays loaded once idle; None: until deleted. A request's own
    # keep_alive overrides it (Ollama's meaning), on the node serving the instance.
    keep_alive_s: float | None = None
    # Placed for a request (on first use, or named at start): if its runner fails or its
    # node leaves it is deleted, not placed again; the next request places it anew.
    on_demand: bool = False
    # Never evicted to make room and never expires (--pin, "pin" on POST /instances).
    pinned: bool = False
    # What serves it: shoal's engine, or a backend some nodes run (placement goes only
    # there). Chosen once, where the placement is asked for (cluster/backends.py).
    backend: BackendName = DEFAULT_BACKEND

    @model_validator(mode="after")
    def _check(self) -> PlacementRequest:
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes must be >= 1, not {self.min_nodes}")
        if self.sharding == "single" and self.min_nodes > 1:
            raise ValueError("single-node sharding cannot have min_nodes > 1")
        if self.backend != DEFAULT_BACKEND and (self.min_nodes > 1 or self.sharding not in
                                                ("auto", "single")):
            raise ValueError(f"{self.backend} serves a model whole on one node: it cannot be "
                             f"split ({self.sharding}, min_nodes {self.min_nodes})")
        return self

    @property
    def model(self) -> ModelId:
        return self.facts.model


class Instance(Frozen):
    """A placed model. ranks[i].rank == i; rank 0 owns the scheduler and serves requests.

    request is what the instance was placed for, kept so the master can re-place it (one
    node wider on a refusal) without the original command.
    """

    instance_id: InstanceId
    request: PlacementRequest
    sharding: Sharding
    ranks: tuple[Rank, ...]
    # Set exactly when the instance has several ranks.
    rendezvous: Rendezvous | None = None
    # Placements of this request so far that failed after creation (re-placement bound).
    attempt: int = 0

    @model_validator(mode="after")
    def _check(self) -> Instance:
        ranks = self.ranks
        if not ranks:
            raise ValueError("an instance needs at least one rank")
        for index, rank in enumerate(ranks):
            if rank.rank != index or rank.world_size != len(ranks):
                raise ValueError(f"rank {index} is numbered {rank.rank} of {rank.world_size}; "
                                 f"ranks must be 0..{len(ranks) - 1} of {len(ranks)}")
        if len({r.node_id for r in ranks}) != len(ranks):
            raise ValueError("each rank of an instance must be on a different node")
        if len({r.runner_id for r in ranks}) != len(ranks):
            raise ValueError("runner ids of an instance must be distinct")
        _check_layout(self.sharding, ranks, self.facts.n_layers)
        _check_experts(self.sharding, ranks, self.facts.n_experts)
        if (len(ranks) > 1) != (self.rendezvous is not None):
            raise ValueError("an instance has a rendezvous exactly when it has several ranks")
        return self

    @property
    def facts(self) -> ModelFacts:
        return self.request.facts

    @property
    def model(self) -> ModelId:
        return self.request.facts.model

    @property
    def node_ids(self) -> tuple[NodeId, ...]:
        return tuple(r.node_id for r in self.ranks)

    @property
    def runner_ids(self) -> tuple[RunnerId, ...]:
        return tuple(r.runner_id for r in self.ranks)

    def rank_on(self, node_id: NodeId) -> Rank | None:
        return next((r for r in self.ranks if r.node_id == node_id), None)


def _check_layout(sharding: Sharding, ranks: tuple[Rank, ...], n_layers: int) -> None:
    if sharding == "single" and len(ranks) != 1:
        raise ValueError(f"a single-node instance has one rank, not {len(ranks)}")
    if sharding in ("single", "tensor", "expert"):
        tensor_split = sharding != "expert"
        for rank in ranks:
            if rank.layers != (0, n_layers):
                raise ValueError(f"{sharding} rank {rank.rank} must hold all layers "
                                 f"[0, {n_layers}), not {list(rank.layers)}")
            expected = (rank.rank, rank.world_size) if tensor_split else (0, 1)
            if (rank.tp_rank, rank.tp_size) != expected:
                raise ValueError(f"{sharding} rank {rank.rank} must have tp_rank "
                                 f"{expected[0]} of {expected[1]}")
        return
    start = 0
    for rank in ranks:
        if rank.layer_start != start or rank.tp_size != 1:
            raise ValueError(f"pipeline rank {rank.rank} must start at layer {start} with "
                             "tp_size 1 (ranges are contiguous)")
        start = rank.layer_end
    if start != n_layers:
        raise ValueError(f"pipeline ranks cover layers [0, {start}), not [0, {n_layers})")


def _check_experts(sharding: Sharding, ranks: tuple[Rank, ...], n_experts: int) -> None:
    """Expert ranks' ranges are contiguous and cover [0, n_experts); others hold none."""
    if sharding != "expert":
        if any(rank.experts is not None for rank in ranks):
            raise ValueError(f"{sharding} ranks hold no expert range")
        return
    start = 0
    for rank in ranks:
        if rank.expert_start != start or rank.expert_end <= start:
            raise ValueError(f"expert rank {rank.rank} must start at expert {start} and hold "
                             "at least one (ranges are contiguous)")
        start = rank.expert_end
    if start != n_experts:
        raise ValueError(f"expert ranks cover experts [0, {start}), not [0, {n_experts})")
