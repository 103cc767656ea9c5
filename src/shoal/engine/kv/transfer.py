"""Moving full prefix blocks' KV out of and into the paged cache (disk tier, other nodes).

The cache is a list of tensors whose axis 1 is the slot axis (slot = block_id * block_size
+ offset): today one [2 * H_kv, slots, D] tensor per local layer (kv/tensors.py); a quantized
cache adds its scale tensors ([2 * H_kv, slots] per layer) to the same list. Everything here
is generic over that list, so an exported prefix holds one CPU tensor per cache tensor with
the slot axis cut down to the prefix's n * block_size slots.

A model split over ranks moves as one instance: its blocks hold rank 0's tensors, then each
other rank's in rank order (RankShares: rank 0 gathers them on export and hands each rank
its own on import), so they move only between instances split the same way.

An import is verified before anything is written: the hash chain (every block's hash follows
from its parent's hash and its own tokens, so a sender cannot register KV under a prefix it
does not hold), the tensors' shapes and dtypes against this cache, and finite values. The
blocks land in free blocks registered in the prefix cache with no reference held, so the
scheduler's normal lookup finds them and the pool may evict them like any cached block.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shoal.engine.kv.block_pool import BlockPool
from shoal.engine.kv.prefix_cache import ROOT_HASH, extend_block_hashes, hash_block

# Per cache tensor: its shape without the slot axis, and its dtype's name.
Layout = tuple[tuple[tuple[int, ...], str], ...]
# (blocks, [(index in blocks, block id it was written to)]) -> how many leading blocks of
# `blocks` every other rank of a split model also stored at those block ids.
Agreement = Callable[["PrefixBlocks", list[tuple[int, int]]], int]


class TransferError(ValueError):
    """Blocks that do not belong in this cache (broken chain, wrong shape or dtype, NaN)."""


class RankShares(Protocol):
    """The other ranks' shares of a split model's blocks (parallel/executor.py,
    LeaderExecutor)."""

    # Each other rank's cache layout, in rank order.
    share_layouts: tuple[Layout, ...]

    def read_prefix(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Every other rank's tensors of these blocks, rank after rank."""
        ...

    def write_prefix(self, blocks: PrefixBlocks, placed: list[tuple[int, int]],
                     shares: Sequence[tuple[torch.Tensor, ...]]) -> int:
        """Each other rank writes its share (shares[rank - 1], all of blocks' blocks) at
        placed's block ids; how many leading blocks every rank wrote."""
        ...


def layout_of(tensors: Sequence[torch.Tensor]) -> Layout:
    """What must match between two caches for blocks to move between them."""
    return tuple(((t.shape[0], *t.shape[2:]), str(t.dtype).removeprefix("torch."))
                 for t in tensors)


def tensor_to_wire(tensor: torch.Tensor) -> dict[str, Any]:
    """A CPU tensor as msgpack-able raw bytes."""
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "data": tensor.contiguous().view(torch.uint8).numpy().tobytes()}


def tensor_from_wire(spec: dict[str, Any]) -> torch.Tensor:
    """A read-only view of the bytes; TransferError when malformed."""
    try:
        dtype = getattr(torch, str(spec["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise TransferError(f"unknown dtype {spec['dtype']!r}")
        with warnings.catch_warnings():  # read-only bytes: an import only reads them
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(spec["data"], dtype=dtype)
        return flat.view(*[int(n) for n in spec["shape"]])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise TransferError(f"malformed tensor: {error}") from None


def layout_to_wire(layout: Layout) -> list:
    return [[list(shape), dtype] for shape, dtype in layout]


def layout_from_wire(wire: list) -> Layout:
    return tuple((tuple(int(n) for n in shape), str(dtype)) for shape, dtype in wire)


@dataclass(frozen=True)
class PrefixBlocks:
    """The KV of n consecutive full prompt blocks that follow parent_hash (ROOT_HASH: the
    prompt's first block).

    token_ids: the n * block_size tokens; block_hashes: their n chained hashes; tensors:
    per cache tensor, [dim 0, n * block_size, *rest] on the CPU (the slot axis is axis 1).
    """

    parent_hash: bytes
    token_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    tensors: tuple[torch.Tensor, ...]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    def block(self, index: int) -> PrefixBlocks:
        """Block `index` alone (views, no copy), its parent being the block before it."""
        size = self.block_size
        parent = self.parent_hash if index == 0 else self.block_hashes[index - 1]
        return PrefixBlocks(parent, self.token_ids[index * size:(index + 1) * size],
                            (self.block_hashes[index],),
                            tuple(t.narrow(1, index * size, size) for t in self.tensors), size)


def join_blocks(parts: Sequence[PrefixBlocks]) -> PrefixBlocks:
    """Consecutive runs of blocks as one (each part's parent is the previous part's end)."""
    if not parts:
        raise TransferError("nothing to join")
    for before, after in zip(parts, parts[1:]):
        if after.parent_hash != before.block_hashes[-1]:
            raise TransferError("the blocks to join do not follow one another")
    first = parts[0]
    tensors = tuple(torch.cat([p.tensors[i] for p in parts], dim=1)
                    for i in range(len(first.tensors)))
    return PrefixBlocks(first.parent_hash, tuple(t for p in parts for t in p.token_ids),
                        tuple(h for p in parts for h in p.block_hashes), tensors,
                        first.block_size)


def block_slots(block_ids: Sequence[int], block_size: int, device: torch.device) -> torch.Tensor:
    """[len(block_ids) * block_size] slot indices, block after block."""
    ids = torch.tensor(list(block_ids), dtype=torch.int64, device=device)
    return (ids[:, None] * block_size + torch.arange(block_size, device=device)).reshape(-1)


def read_blocks(cache: Sequence[torch.Tensor], block_ids: Sequence[int],
                block_size: int) -> tuple[torch.Tensor, ...]:
    """Copies of the given blocks' slots, per cache tensor, on the CPU."""
    if not cache:
        return ()
    slots = block_slots(block_ids, block_size, cache[0].device)
    return tuple(t.index_select(1, slots).cpu() for t in cache)


def write_blocks(cache: Sequence[torch.Tensor], block_ids: Sequence[int], block_size: int,
                 tensors: Sequence[torch.Tensor]) -> None:
    """Store tensors (as read_blocks returns them) into the given blocks' slots."""
    if not cache:
        return
    slots = block_slots(block_ids, block_size, cache[0].device)
    for target, source in zip(cache, tensors):
        target.index_copy_(1, slots, source.to(target.device))


def verify(blocks: PrefixBlocks, layout: Layout, block_size: int) -> None:
    """Raise TransferError unless blocks may enter a cache of this layout and block size."""
    if blocks.block_size != block_size:
        raise TransferError(f"blocks of {blocks.block_size} tokens cannot enter a cache of "
                            f"{block_size}-token blocks")
    count = blocks.num_blocks
    if count == 0 or len(blocks.token_ids) != count * block_size:
        raise TransferError(f"{len(blocks.token_ids)} tokens do not fill {count} blocks")
    parent = blocks.parent_hash
    for index, expected in enumerate(blocks.block_hashes):
        parent = hash_block(parent, blocks.token_ids[index * block_size:(index + 1) * block_size])
        if parent != expected:
            raise TransferError(f"block {index}'s hash does not follow from its parent and "
                                f"its tokens")
    check_tensors(blocks.tensors, layout, count * block_size)


def check_tensors(tensors: Sequence[torch.Tensor], layout: Layout, slots: int) -> None:
    """TransferError unless tensors match layout around `slots` slots, with finite values."""
    if len(tensors) != len(layout):
        raise TransferError(f"{len(tensors)} tensors for a cache of {len(layout)}")
    for index, (tensor, (shape, dtype)) in enumerate(zip(tensors, layout)):
        got = (tensor.shape[0], *tensor.shape[2:])
        name = str(tensor.dtype).removeprefix("torch.")
        if got != shape or name != dtype or tensor.dim() < 2 or tensor.shape[1] != slots:
            raise TransferError(f"tensor {index} is {name} {tuple(tensor.shape)}; this cache "
                                f"needs {dtype} with shape {shape} around {slots} slots")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise TransferError(f"tensor {index} holds values that are not finite")


class PrefixTransfer:
    """Export and import of prefix blocks for one engine (its pool and cache tensors)."""

    def __init__(self, pool: BlockPool, cache: Callable[[], list[torch.Tensor]],
                 block_size: int, ranks: RankShares | None = None) -> None:
        self._pool = pool
        self.cache = cache
        self.block_size = block_size
        self._ranks = ranks  # None: a model served whole
        self._shares = ranks.share_layouts if ranks is not None else ()

    @property
    def layout(self) -> Layout:
        """This rank's cache (its disk tier's blocks)."""
        return layout_of(self.cache())

    @property
    def instance_layout(self) -> Layout:
        """Every rank's cache, rank after rank: what export() and import_instance() move."""
        return self.layout + tuple(x for share in self._shares for x in share)

    def export(self, token_ids: Sequence[int], max_blocks: int | None = None
               ) -> PrefixBlocks | None:
        """The KV of the longest cached prefix of token_ids (read as a prompt), every rank's
        share; None when not even its first block is cached."""
        hashes = extend_block_hashes([], list(token_ids), self.block_size)[:max_blocks]
        block_ids = self._pool.find_cached(hashes)
        if not block_ids:
            return None
        count = len(block_ids)
        tensors = read_blocks(self.cache(), block_ids, self.block_size)
        if self._ranks is not None:
            tensors += self._ranks.read_prefix(block_ids)
        return PrefixBlocks(ROOT_HASH, tuple(token_ids[:count * self.block_size]),
                            tuple(hashes[:count]),
                            tensors, self.block_size)

    def import_instance(self, blocks: PrefixBlocks) -> int:
        """import_() of blocks export() made on an instance split the same way: every
        rank's share verified here, then each rank stores its own; a block counts only
        once every rank stored it."""
        verify(blocks, self.instance_layout, self.block_size)
        ranks = self._ranks
        if ranks is None:
            return self.import_(blocks)
        own = len(self.layout)
        shares, first = [], own
        for layout in self._shares:
            shares.append(blocks.tensors[first:first + len(layout)])
            first += len(layout)
        return self.import_(dataclasses.replace(blocks, tensors=blocks.tensors[:own]),
                            agree=lambda mine, placed: ranks.write_prefix(mine, placed, shares))

    def import_(self, blocks: PrefixBlocks, keep: Sequence[int] = (),
                agree: Agreement | None = None) -> int:
        """Verify blocks and store those not cached yet in free blocks, registered in the
        prefix cache. keep: cached blocks (e.g. the prefix these blocks extend) that the
        allocation must not evict. agree: for one rank of a split model, asked after this
        rank wrote its share and before anything is registered; only blocks before the
        count it returns are registered (the others go back free). Returns how many blocks
        were stored; 0 when the pool has too few free blocks (nothing is evicted that a
        request holds). TransferError when the blocks fail verification."""
        cache = self.cache()
        verify(blocks, layout_of(cache), self.block_size)
        pool = self._pool
        if not pool.enable_prefix_caching:
            return 0
        missing = [i for i, h in enumerate(blocks.block_hashes)
                   if not pool.prefix_cache.lookup([h])]
        if not missing:
            return 0
        pool.touch(keep)
        try:
            if not pool.can_allocate(len(missing)):
                return 0
            block_ids = pool.allocate(len(missing))
            try:
                tensors = blocks.tensors if len(missing) == blocks.num_blocks \
                    else pick_blocks(blocks, missing)
                write_blocks(cache, block_ids, self.block_size, tensors)
                placed = list(zip(missing, block_ids))
                if agree is not None:
                    count = agree(blocks, placed)
                    placed = [(index, block_id) for index, block_id in placed if index < count]
                for index, block_id in placed:
                    pool.cache_block(blocks.block_hashes[index], block_id)
            finally:
                pool.free(block_ids)
        finally:
            pool.free(keep)
        return len(placed)


def pick_blocks(blocks: PrefixBlocks, indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """The tensors of the chosen blocks, concatenated along the slot axis."""
    size = blocks.block_size
    return tuple(torch.cat([t.narrow(1, i * size, size) for i in indices], dim=1)
                 for t in blocks.tensors)
