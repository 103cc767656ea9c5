"""Prefix blocks out of one cache and into another: round trips, verification, pool limits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shoal.engine.kv.block_pool import BlockPool
from shoal.engine.kv.prefix_cache import ROOT_HASH, extend_block_hashes
from shoal.engine.kv.transfer import PrefixTransfer, TransferError, join_blocks

BLOCK = 4
NUM_BLOCKS = 8


def make_cache(seed: int) -> list[torch.Tensor]:
    """Two layers of an int8 cache with per-slot scales: every tensor's axis 1 is slots."""
    generator = torch.Generator().manual_seed(seed)
    slots = NUM_BLOCKS * BLOCK
    cache = []
    for _ in range(2):
        cache.append(torch.randint(-127, 127, (4, slots, 8), generator=generator,
                                   dtype=torch.int8))
        cache.append(torch.rand((4, slots), generator=generator))
    return cache


def fill(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Cache tokens' full blocks as a finished request would leave them."""
    hashes = extend_block_hashes([], tokens, BLOCK)
    block_ids = pool.allocate(len(hashes))
    for block_hash, block_id in zip(hashes, block_ids):
        pool.cache_block(block_hash, block_id)
    pool.free(block_ids)
    return block_ids


def slots_of(block_ids):
    return [b * BLOCK + o for b in block_ids for o in range(BLOCK)]


TOKENS = list(range(100, 114))  # 3 full blocks and 2 tokens more


def test_a_prefix_moves_to_another_cache_and_is_found_there():
    source_pool, target_pool = BlockPool(NUM_BLOCKS), BlockPool(NUM_BLOCKS)
    source_cache, target_cache = make_cache(1), make_cache(2)
    source_ids = fill(source_pool, TOKENS)
    exported = PrefixTransfer(source_pool, lambda: source_cache, BLOCK).export(TOKENS)
    assert exported.num_blocks == 3 and exported.parent_hash == ROOT_HASH
    assert exported.token_ids == tuple(TOKENS[:12])
    assert [t.shape[1] for t in exported.tensors] == [12] * 4

    stored = PrefixTransfer(target_pool, lambda: target_cache, BLOCK).import_(exported)

    assert stored == 3
    hashes = extend_block_hashes([], TOKENS, BLOCK)
    target_ids = target_pool.find_cached(hashes)
    assert len(target_ids) == 3
    assert target_pool.num_free_blocks == NUM_BLOCKS  # cached, held by nobody
    for source, target in zip(source_cache, target_cache):
        assert torch.equal(source[:, slots_of(source_ids)], target[:, slots_of(target_ids)])


def test_export_stops_at_the_first_block_not_cached():
    pool, cache = BlockPool(NUM_BLOCKS), make_cache(1)
    fill(pool, TOKENS[:8])
    transfer = PrefixTransfer(pool, lambda: cache, BLOCK)
    assert transfer.export(TOKENS).num_blocks == 2
    assert transfer.export(TOKENS, max_blocks=1).num_blocks == 1
    assert transfer.export([7] * 12) is None


def test_only_blocks_not_cached_yet_are_stored():
    source_pool, target_pool = BlockPool(NUM_BLOCKS), BlockPool(NUM_BLOCKS)
    source_cache, target_cache = make_cache(1), make_cache(2)
    fill(source_pool, TOKENS)
    fill(target_pool, TOKENS[:4])  # the target holds the first block already
    exported = PrefixTransfer(source_pool, lambda: source_cache, BLOCK).export(TOKENS)
    target = PrefixTransfer(target_pool, lambda: target_cache, BLOCK)
    assert target.import_(exported) == 2
    assert target.import_(exported) == 0
    assert len(target_pool.find_cached(exported.block_hashes)) == 3


def test_blocks_split_and_joined_import_like_the_whole():
    pool, cache = BlockPool(NUM_BLOCKS), make_cache(1)
    fill(pool, TOKENS)
    exported = PrefixTransfer(pool, lambda: cache, BLOCK).export(TOKENS)
    parts = [exported.block(i) for i in range(exported.num_blocks)]
    assert parts[1].parent_hash == exported.block_hashes[0]
    joined = join_blocks(parts)
    assert joined.block_hashes == exported.block_hashes
    assert all(torch.equal(a, b) for a, b in zip(joined.tensors, exported.tensors))
    with pytest.raises(TransferError, match="do not follow"):
        join_blocks([parts[0], parts[2]])


def exported_prefix():
    pool, cache = BlockPool(NUM_BLOCKS), make_cache(1)
    fill(pool, TOKENS)
    return PrefixTransfer(pool, lambda: cache, BLOCK).export(TOKENS)


def bad_tensors(blocks, index, tensor):
    tensors = list(blocks.tensors)
    tensors[index] = tensor
    return dataclasses.replace(blocks, tensors=tuple(tensors))


@pytest.mark.parametrize("spoil, message", [
    (lambda b: dataclasses.replace(b, token_ids=(1,) + b.token_ids[1:]), "does not follow"),
    (lambda b: dataclasses.replace(b, parent_hash=b"other"), "does not follow"),
    (lambda b: dataclasses.replace(b, token_ids=b.token_ids[:-1]), "do not fill"),
    (lambda b: dataclasses.replace(b, block_size=8), "8 tokens"),
    (lambda b: dataclasses.replace(b, tensors=b.tensors[:3]), "3 tensors"),
    (lambda b: bad_tensors(b, 1, b.tensors[1].double()), "float64"),
    (lambda b: bad_tensors(b, 0, b.tensors[0][:2]), "shape"),
    (lambda b: bad_tensors(b, 1, b.tensors[1][:, :8]), "slots"),
    (lambda b: bad_tensors(b, 3, torch.full_like(b.tensors[3], float("nan"))), "not finite"),
])
def test_blocks_that_do_not_belong_are_refused_before_anything_is_written(spoil, message):
    blocks = spoil(exported_prefix())
    pool, cache = BlockPool(NUM_BLOCKS), make_cache(2)
    before = [t.clone() for t in cache]
    with pytest.raises(TransferError, match=message):
        PrefixTransfer(pool, lambda: cache, BLOCK).import_(blocks)
    assert len(pool.prefix_cache) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, cache))


def test_a_full_pool_stores_nothing_and_evicts_no_block_held_by_a_request():
    blocks = exported_prefix()
    pool, cache = BlockPool(NUM_BLOCKS), make_cache(2)
    held = pool.allocate(NUM_BLOCKS - 2)  # a running request's blocks
    assert PrefixTransfer(pool, lambda: cache, BLOCK).import_(blocks) == 0
    assert len(pool.prefix_cache) == 0
    assert [pool.ref_count(b) for b in held] == [1] * len(held)


def test_kept_blocks_survive_the_import_s_allocation():
    blocks = exported_prefix()
    pool, cache = BlockPool(4), make_cache(2)
    kept = fill(pool, [9, 9, 9, 9])  # a cached prefix the import must not evict
    transfer = PrefixTransfer(pool, lambda: cache, BLOCK)
    assert transfer.import_(blocks, keep=kept) == 3
    assert pool.find_cached(extend_block_hashes([], [9, 9, 9, 9], BLOCK)) == kept
    assert pool.num_free_blocks == 4
