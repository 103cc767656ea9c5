"""ParallelConfig: this runner's place in a multi-rank instance."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from shoal.sharding import EVERY_LAYER_SHARDINGS, MULTI_RANK_SHARDINGS, Sharding


@dataclass(frozen=True)
class ParallelConfig:
    """rank of world_size; a pipeline rank holds layers [layer_start, layer_end), a tensor
    rank holds every layer and 1/world_size of each layer's heads and MLP columns, an expert
    rank holds every layer and experts [expert_start, expert_end) of each mixture-of-experts
    layer (the rest of every layer whole).

    Ranks meet at master_addr:master_port (rank 0's node) within connect_timeout_s, each
    proving rank_key (hex, from the cluster secret; "" when the cluster has none). Every
    later wait on another rank is bounded by collective_timeout_s; rank 0 sends a keep-alive
    step every keepalive_s while idle, so a silent rank 0 is noticed too.
    """

    rank: int
    world_size: int
    sharding: Sharding  # pipeline, tensor or expert: a single rank has no ParallelConfig
    layer_start: int
    layer_end: int
    master_addr: str
    master_port: int
    # An expert rank's experts of each mixture-of-experts layer (0, 0 for other shardings).
    expert_start: int = 0
    expert_end: int = 0
    connect_timeout_s: float = 120.0
    collective_timeout_s: float = 5.0
    keepalive_s: float = 1.0
    # Hidden states between pipeline ranks as int8 with one scale per token.
    compress_hidden: bool = False
    # A wait on another rank polls its link this long before it sleeps (parallel/links.py):
    # while steps flow the waiting core stays awake, at the cost of keeping it busy.
    spin_s: float = 0.02
    # HMAC key for the rendezvous and the links (parallel/proof.py); never shown or logged.
    rank_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.world_size < 2 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} of world size {self.world_size}: a parallel "
                             "instance has at least two ranks")
        if self.sharding not in MULTI_RANK_SHARDINGS:
            raise ValueError(f"sharding must be pipeline, tensor or expert, not "
                             f"{self.sharding!r}")
        if self.sharding == "expert" and not 0 <= self.expert_start < self.expert_end:
            raise ValueError(f"invalid expert range [{self.expert_start}, {self.expert_end})")
        if self.sharding != "expert" and (self.expert_start, self.expert_end) != (0, 0):
            raise ValueError("an expert range needs expert sharding")
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"invalid layer range [{self.layer_start}, {self.layer_end})")
        if not 0 < self.master_port < 65536 or not self.master_addr:
            raise ValueError(f"invalid rendezvous {self.master_addr}:{self.master_port}")
        if self.keepalive_s * 2 >= self.collective_timeout_s:
            raise ValueError("keepalive_s must be under half of collective_timeout_s")
        if self.connect_timeout_s <= 0:
            raise ValueError("connect_timeout_s must be positive")
        if self.spin_s < 0:
            raise ValueError("spin_s must not be negative")
        if self.rank_key and not re.fullmatch(r"[0-9a-f]{64}", self.rank_key):
            raise ValueError("rank_key must be 64 hex digits, or empty")

    @property
    def tp_rank(self) -> int:
        return self.rank if self.sharding == "tensor" else 0

    @property
    def tp_size(self) -> int:
        return self.world_size if self.sharding == "tensor" else 1

    @property
    def runs_every_layer(self) -> bool:
        """Every rank runs every layer on its part of each (tensor, expert): rank 0 samples
        from the logits it computes. Otherwise hidden states pass from rank to rank."""
        return self.sharding in EVERY_LAYER_SHARDINGS

    @property
    def expert_range(self) -> tuple[int, int] | None:
        return (self.expert_start, self.expert_end) if self.sharding == "expert" else None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def layer_range(self) -> tuple[int, int]:
        return (self.layer_start, self.layer_end)
