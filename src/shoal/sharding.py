"""How an instance's model is split over its ranks: one word for the cluster and the engine.

single: one rank holds every layer. pipeline: each rank holds a half-open range of layers
that keeps the original layer indices. tensor: every rank holds every layer and 1/world_size
of each layer's heads and MLP columns. The strings are what the wire and the event log carry.
"""

from __future__ import annotations

from typing import Literal

Sharding = Literal["single", "pipeline", "tensor"]
# What a client asks for: a sharding, or "auto" to let placement choose one.
RequestedSharding = Literal["auto", Sharding]

# The shardings that split a model over two or more ranks (each rank has a ParallelConfig).
MULTI_RANK_SHARDINGS: tuple[Sharding, ...] = ("pipeline", "tensor")
