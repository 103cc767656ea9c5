"""Block pool: ref counts, free list order, prefix-cache retention and LRU eviction."""

from __future__ import annotations

import pytest

from shoal.engine.kv.block_pool import BlockPool
from shoal.engine.kv.prefix_cache import extend_block_hashes


def test_allocate_and_free_track_counts():
    pool = BlockPool(4)
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    pool.free(blocks)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0


def test_over_allocation_and_double_free_raise():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError):
        pool.free(blocks)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_freed_cached_blocks_stay_findable_until_evicted():
    pool = BlockPool(3)
    hashes = extend_block_hashes([], list(range(8)), 4)
    blocks = pool.allocate(2)
    for block_hash, block_id in zip(hashes, blocks):
        pool.cache_block(block_hash, block_id)
    pool.free(blocks)
    assert pool.num_free_blocks == 3
    assert pool.find_cached(hashes) == blocks
    # The never-cached block goes first; then LRU takes the cached tail block (freed first).
    pool.allocate(1)
    assert pool.find_cached(hashes) == blocks
    pool.allocate(1)
    assert pool.find_cached(hashes) == blocks[:1]
    assert pool.num_evictions == 1


def test_touch_shares_a_block_and_pulls_it_off_the_free_list():
    pool = BlockPool(2)
    (block_hash,) = extend_block_hashes([], [1, 2, 3, 4], 4)
    (block,) = pool.allocate(1)
    pool.cache_block(block_hash, block)
    pool.touch([block])  # a second request shares it
    assert pool.ref_count(block) == 2
    pool.free([block])
    pool.free([block])
    assert pool.is_free(block)
    pool.touch(pool.find_cached([block_hash]))
    assert not pool.is_free(block) and pool.num_free_blocks == 1


def test_uncached_freed_blocks_are_reused_before_cached_ones():
    pool = BlockPool(2)
    (block_hash,) = extend_block_hashes([], [1, 2, 3, 4], 4)
    cached, scratch = pool.allocate(2)
    pool.cache_block(block_hash, cached)
    pool.free([cached, scratch])
    assert pool.allocate(1) == [scratch]
    assert pool.find_cached([block_hash]) == [cached]


def test_disabled_prefix_caching_finds_nothing():
    pool = BlockPool(2, enable_prefix_caching=False)
    (block_hash,) = extend_block_hashes([], [1, 2, 3, 4], 4)
    (block,) = pool.allocate(1)
    pool.cache_block(block_hash, block)
    assert pool.find_cached([block_hash]) == []


def test_free_blocks_kept_for_the_prefix_cache_are_counted():
    from shoal.engine.kv.block_pool import BlockPool

    pool = BlockPool(6)
    first, second = pool.allocate(2)
    (block_hash,) = extend_block_hashes([], [1, 2, 3, 4], 4)
    pool.cache_block(block_hash, first)
    assert pool.num_cached_free_blocks == 0  # still referenced
    pool.free([first, second])
    assert pool.num_cached_free_blocks == 1  # the cached one is kept, the other is not
    pool.allocate(6)  # takes every block, evicting the cached one last
    assert pool.num_cached_free_blocks == 0


def test_resident_free_blocks_are_cached_and_spent_ones():
    from shoal.engine.kv.block_pool import BlockPool

    pool = BlockPool(6)
    first, second = pool.allocate(2)
    (block_hash,) = extend_block_hashes([], [1, 2, 3, 4], 4)
    pool.cache_block(block_hash, first)
    assert (pool.num_touched_blocks, pool.num_resident_free_blocks) == (2, 0)
    pool.free([first, second])
    assert pool.num_resident_free_blocks == 2  # the cached block and the spent one
    assert pool.allocate(1) == [second]  # a spent block is reused before any fresh one
    assert (pool.num_touched_blocks, pool.num_resident_free_blocks) == (2, 1)
    pool.allocate(3)  # the cached block is evicted only after the never-used ones
    assert (pool.num_touched_blocks, pool.num_resident_free_blocks) == (5, 1)
    assert pool.num_cached_free_blocks == 1


def test_the_grant_bounds_the_blocks_ever_touched():
    from shoal.engine.kv.block_pool import BlockPool

    pool = BlockPool(8)
    pool.set_grant(3)
    assert pool.num_free_blocks == 3  # the rest of the capacity waits for a larger grant
    first = pool.allocate(3)
    assert first == [0, 1, 2] and pool.num_touched_blocks == 3
    assert not pool.can_allocate(2)
    assert pool.shortfall_blocks == 2  # what the next grant should add
    pool.free(first)
    assert sorted(pool.allocate(3)) == [0, 1, 2]  # spent blocks come back; no fresh one is touched
    assert pool.num_touched_blocks == 3
    pool.set_grant(5)
    assert pool.shortfall_blocks == 0 and pool.allocate(2) == [3, 4]
    pool.set_grant(1)  # a grant never takes back resident blocks
    assert pool.granted_blocks == 5


def test_within_the_grant_a_fresh_block_goes_before_a_cached_one_is_evicted():
    from shoal.engine.kv.block_pool import BlockPool

    pool = BlockPool(4)
    pool.set_grant(2)
    (block,) = pool.allocate(1)
    (block_hash,) = extend_block_hashes([], [1, 2, 3, 4], 4)
    pool.cache_block(block_hash, block)
    pool.free([block])
    assert pool.allocate(1) == [1] and pool.num_evictions == 0
    assert pool.allocate(1) == [block] and pool.num_evictions == 1  # the grant is spent


def test_the_free_tail_is_given_back_down_to_the_highest_block_in_use():
    from shoal.engine.kv.block_pool import BlockPool

    pool = BlockPool(16)
    pool.set_grant(12)
    blocks = pool.allocate(10)
    (block_hash,) = extend_block_hashes([], [1, 2, 3, 4], 4)
    pool.cache_block(block_hash, blocks[8])
    pool.free(blocks[6:])  # blocks 6..9 free (8 cached), 0..5 in use
    released = pool.release_free_tail(keep_blocks=4)
    assert list(released) == [6, 7, 8, 9]  # 5 is in use: nothing below it goes
    assert pool.num_touched_blocks == 6 and pool.granted_blocks == 6
    assert pool.find_cached([block_hash]) == []  # its prefix went with it
    assert pool.num_resident_free_blocks == 0 and not pool.can_allocate(1)
    pool.free(blocks[:6])
    assert list(pool.release_free_tail(keep_blocks=4)) == [4, 5]
    assert pool.granted_blocks == 4 and pool.allocate(4) == [0, 1, 2, 3]  # resident ones
