"""How an instance's model is split over its ranks: one word for the cluster and the engine.

single: one rank holds every layer. pipeline: each rank holds a half-open range of layers
that keeps the original layer indices. tensor: every rank holds every layer and 1/world_size
of each layer's heads and MLP columns. expert: every rank holds every layer whole except a
mixture-of-experts model's routed experts, of which it holds a contiguous range in each such
layer. The strings are what the wire and the event log carry.
"""

from __future__ import annotations

from typing import Literal

Sharding = Literal["single", "pipeline", "tensor", "expert"]
# What a client asks for: a sharding, or "auto" to let placement choose one.
RequestedSharding = Literal["auto", Sharding]

# The shardings that split a model over two or more ranks (each rank has a ParallelConfig).
MULTI_RANK_SHARDINGS: tuple[Sharding, ...] = ("pipeline", "tensor", "expert")
# The shardings whose every rank runs every layer (on its part of each), so rank 0 samples.
EVERY_LAYER_SHARDINGS: tuple[Sharding, ...] = ("tensor", "expert")
