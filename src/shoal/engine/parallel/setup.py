"""Bringing up one rank: join the group, load this rank's part, agree on the KV cache.

Every rank joins first and loads after, so no rank spends memory and minutes on weights
before all of them are there. The ranks' KV pools must have the same number of blocks (rank
0's scheduler hands out block ids for all of them): each rank sizes its own pool for its
layers and heads, and rank 0 takes the smallest, along with the context that allows.
Rank 0 also tells the others its tokenizer's end tokens (the last pipeline rank samples),
and learns each rank's KV cache layout (prefix blocks moving between instances carry every
rank's share: kv/transfer.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import torch

from shoal.engine.config import EngineConfig
from shoal.engine.errors import GroupError
from shoal.engine.kv.tensors import allocate_kv_cache
from shoal.engine.kv.transfer import Layout, layout_from_wire, layout_of, layout_to_wire
from shoal.engine.kv_budget import plan_kv_cache
from shoal.engine.models.loader import LoadedModel, load_model
from shoal.engine.parallel.config import ParallelConfig
from shoal.engine.parallel.executor import HiddenWire
from shoal.engine.parallel.group import RankGroup
from shoal.engine.parallel.shard import TensorShard

Progress = Callable[[str, float], None]


@dataclass
class RankSetup:
    parallel: ParallelConfig
    group: RankGroup
    loaded: LoadedModel
    num_blocks: int
    max_model_len: int
    row_buffer_tokens: int  # the decode row buffer's slots (the same on every rank)
    eos_token_ids: tuple[int, ...]
    share_layouts: tuple[Layout, ...]  # rank 0: ranks 1.. caches' layouts; others: ()

    def hidden_wire(self) -> HiddenWire:
        return HiddenWire(self.group, self.loaded.config.hidden_size,
                          self.loaded.compute_dtype, self.parallel.compress_hidden)


def set_up_rank(config: EngineConfig, progress: Progress,
                eos_token_ids: tuple[int, ...] = ()) -> RankSetup:
    """Join, load and agree (GroupError if another rank is missing or fails meanwhile).
    eos_token_ids: rank 0's end tokens (ignored on the other ranks, which receive them)."""
    parallel = config.parallel
    if parallel is None:
        raise ValueError("set_up_rank needs EngineConfig.parallel")
    progress("group", 0.0)
    group = RankGroup.join(parallel, torch.device(config.device))
    try:
        shard = (TensorShard(parallel.tp_rank, parallel.tp_size)
                 if parallel.sharding == "tensor" else None)
        loaded = load_model(config.source, config.dtype, device=config.device,
                            layer_range=parallel.layer_range,
                            progress=lambda f: progress("weights", f), shard=shard,
                            reduce=group.all_reduce_ if parallel.runs_every_layer else None,
                            kv_cache_dtype=config.kv_cache_dtype,
                            experts=parallel.expert_range)
        own = plan_kv_cache(config, loaded.config, loaded)
        start, end = loaded.layer_range
        layout = layout_of(allocate_kv_cache(loaded.config, end - start, 1, config.block_size,
                                             loaded.cache_dtype, "meta"))
        sizes = [own.num_blocks, own.max_model_len, own.row_buffer_tokens]
        agreed = _agree(group, parallel, sizes, tuple(eos_token_ids), layout)
    except BaseException:
        group.close()
        raise
    (num_blocks, max_len, row_buffer_tokens), eos, layouts = agreed
    return RankSetup(parallel, group, loaded, num_blocks, max_len, row_buffer_tokens, eos, layouts)


def _agree(group: RankGroup, parallel: ParallelConfig, sizes: list[int],
           eos_token_ids: tuple[int, ...], layout: Layout
           ) -> tuple[list[int], tuple[int, ...], tuple[Layout, ...]]:
    """The smallest of each rank's sizes (blocks, context, row buffer slots), rank 0's eos, and
    (on rank 0) the other ranks' cache layouts."""
    # Ranks finish loading at different times: these waits get the group-formation bound.
    wait_s = parallel.connect_timeout_s
    if parallel.rank != 0:
        group.send_bytes(msgpack.packb([sizes, layout_to_wire(layout)]), 0)
        agreed = msgpack.unpackb(group.recv_bytes(0, timeout_s=wait_s, spin=False))
        return agreed[0], tuple(agreed[1]), ()
    layouts = []
    for rank in range(1, parallel.world_size):
        theirs, their_layout = msgpack.unpackb(
            group.recv_bytes(rank, timeout_s=wait_s, spin=False))
        sizes = [min(mine, other) for mine, other in zip(sizes, theirs)]
        layouts.append(layout_from_wire(their_layout))
    if sizes[0] < 1:
        raise GroupError("a rank has no memory for its KV cache")
    answer = msgpack.packb([sizes, list(eos_token_ids)])
    for rank in range(1, parallel.world_size):
        group.send_bytes(answer, rank)
    return sizes, eos_token_ids, tuple(layouts)
