"""Chained block hashes and the hash -> block index."""

from __future__ import annotations

import pytest

from shoal.engine.kv.prefix_cache import PrefixCache, extend_block_hashes, hash_block


def test_only_full_blocks_are_hashed():
    assert len(extend_block_hashes([], list(range(7)), 4)) == 1
    assert len(extend_block_hashes([], list(range(8)), 4)) == 2
    assert extend_block_hashes([], [1, 2, 3], 4) == []


def test_hash_is_chained_on_the_whole_prefix():
    a = extend_block_hashes([], [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = extend_block_hashes([], [9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 1, different parents
    assert a == extend_block_hashes([], [1, 2, 3, 4, 5, 6, 7, 8], 4)


def test_extending_hashes_only_the_new_blocks():
    tokens = list(range(12))
    hashes = extend_block_hashes([], tokens[:5], 4)
    assert extend_block_hashes(hashes, tokens, 4) == extend_block_hashes([], tokens, 4)
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])


def test_block_size_is_validated():
    with pytest.raises(ValueError):
        extend_block_hashes([], [1, 2], 0)


def test_lookup_returns_longest_cached_prefix():
    cache = PrefixCache()
    hashes = extend_block_hashes([], list(range(16)), 4)
    cache.insert(hashes[0], 10)
    cache.insert(hashes[1], 11)
    cache.insert(hashes[3], 13)  # not reachable: block 2 is missing
    assert cache.lookup(hashes) == [10, 11]
    assert cache.lookup(hashes[2:]) == []


def test_duplicate_content_keeps_the_first_block():
    cache = PrefixCache()
    (block_hash,) = extend_block_hashes([], [1, 2, 3, 4], 4)
    assert cache.insert(block_hash, 1)
    assert not cache.insert(block_hash, 2)
    assert cache.lookup([block_hash]) == [1]
    assert cache.hash_of(2) is None


def test_forget_removes_both_directions():
    cache = PrefixCache()
    (block_hash,) = extend_block_hashes([], [1, 2, 3, 4], 4)
    cache.insert(block_hash, 3)
    cache.forget(3)
    cache.forget(3)  # idempotent
    assert cache.lookup([block_hash]) == [] and len(cache) == 0


def test_lookup_statistics():
    cache = PrefixCache()
    cache.record_lookup(20, 0)
    cache.record_lookup(20, 16)
    assert (cache.query_tokens, cache.hit_tokens, cache.hit_requests) == (40, 16, 1)


def test_the_journal_reports_each_batch_of_gains_and_losses_netted_out():
    cache = PrefixCache()
    a, b, c = (hash_block(b"root", [i]) for i in range(3))
    cache.insert(a, 0)
    cache.insert(b, 1)
    assert cache.has_changes
    stored, removed = cache.drain_changes()
    assert sorted(stored) == sorted([a, b]) and removed == []
    assert not cache.has_changes
    cache.insert(c, 2)
    cache.forget(2)  # gained and lost in one batch: nothing to say about c
    cache.forget(0)
    cache.insert(a, 3)  # lost and regained: still held, nothing to say about a
    cache.forget(1)
    assert cache.drain_changes() == ([], [b])
    cache.clear()
    assert cache.drain_changes() == ([], [a])
