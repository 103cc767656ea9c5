"""The SSD tier on its own: files, restarts, corruption, LRU and TTL, full or read-only disks."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import pytest
import torch

from shoal.engine.kv.disk_format import CorruptBlock, decode_block, encode_block
from shoal.engine.kv.disk_tier import DiskTier
from shoal.engine.kv.prefix_cache import ROOT_HASH, extend_block_hashes
from shoal.engine.kv.transfer import PrefixBlocks, PrefixTransfer

BLOCK = 4
TOKENS = list(range(40, 56))  # 4 blocks


def chain(tokens=TOKENS, seed=0) -> list[PrefixBlocks]:
    """One PrefixBlocks per block: a bfloat16 KV tensor and a float32 scale tensor each."""
    generator = torch.Generator().manual_seed(seed)
    hashes = extend_block_hashes([], tokens, BLOCK)
    blocks, parent = [], ROOT_HASH
    for index, block_hash in enumerate(hashes):
        tensors = (torch.randn((6, BLOCK, 8), generator=generator).to(torch.bfloat16),
                   torch.rand((6, BLOCK), generator=generator))
        blocks.append(PrefixBlocks(parent, tuple(tokens[index * BLOCK:(index + 1) * BLOCK]),
                                   (block_hash,), tensors, BLOCK))
        parent = block_hash
    return blocks


# Files differ by a few header bytes (their tokens); the largest bounds them all.
BLOCK_FILE_BYTES = max(len(encode_block(block)) for block in chain())


def open_tier(directory, max_bytes=1 << 30, ttl_s=3600.0, **options) -> DiskTier:
    return DiskTier(directory, max_bytes, ttl_s, BLOCK, **options)


def stored(directory, blocks, **options) -> DiskTier:
    tier = open_tier(directory, **options)
    for block in blocks:
        assert tier.save(block)
    assert tier.wait_written(10)
    return tier


def same(a: PrefixBlocks, b: PrefixBlocks) -> bool:
    return (a.block_hashes == b.block_hashes and a.parent_hash == b.parent_hash
            and a.token_ids == b.token_ids
            and all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors)))


def hashes_of(blocks):
    return [b.block_hashes[0] for b in blocks]


def test_a_block_file_round_trips_and_any_damage_is_caught():
    block = chain()[1]
    data = bytearray(encode_block(block))
    assert same(decode_block(bytearray(data), BLOCK), block)
    flipped = bytearray(data)
    flipped[-3] ^= 0x40
    with pytest.raises(CorruptBlock, match="checksum"):
        decode_block(flipped, BLOCK)
    with pytest.raises(CorruptBlock):
        decode_block(data[:-10], BLOCK)
    with pytest.raises(CorruptBlock, match="not a shoal"):
        decode_block(bytearray(b"garbage" * 10), BLOCK)


def test_blocks_survive_a_restart_and_load_in_chain_order(tmp_path):
    blocks = chain()
    stored(tmp_path, blocks).close()
    assert len(list(tmp_path.glob("*.kv"))) == 4

    tier = open_tier(tmp_path)
    assert tier.num_blocks == 4
    assert tier.num_bytes == sum(len(encode_block(block)) for block in blocks)
    loaded = tier.load(hashes_of(blocks), ROOT_HASH)
    assert len(loaded) == 4 and all(same(a, b) for a, b in zip(loaded, blocks))
    # A chain read from the middle needs the right parent.
    assert len(tier.load(hashes_of(blocks)[2:], blocks[1].block_hashes[0])) == 2
    tier.close()


def test_a_corrupt_file_is_ignored_and_removed(tmp_path):
    blocks = chain()
    stored(tmp_path, blocks).close()
    damaged = tmp_path / (blocks[2].block_hashes[0].hex() + ".kv")
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))

    tier = open_tier(tmp_path)
    loaded = tier.load(hashes_of(blocks), ROOT_HASH)
    assert len(loaded) == 2  # up to the damaged block
    assert not damaged.exists() and tier.num_blocks == 3 and tier.stats["corrupt"] == 1
    tier.close()


def test_partial_leftover_and_foreign_files_are_handled_at_start(tmp_path):
    blocks = chain()
    stored(tmp_path, blocks).close()
    cut = tmp_path / (blocks[3].block_hashes[0].hex() + ".kv")
    cut.write_bytes(cut.read_bytes()[:-100])
    garbage = tmp_path / ("ab" * 16 + ".kv")
    garbage.write_bytes(b"not a block")
    leftover = tmp_path / ".whatever.kv.123.tmp"
    leftover.write_bytes(b"half a write")
    notes = tmp_path / "README"
    notes.write_text("kept")

    tier = open_tier(tmp_path)
    assert tier.num_blocks == 3 and tier.stats["corrupt"] == 2
    assert not cut.exists() and not garbage.exists() and not leftover.exists()
    assert notes.exists()
    tier.close()


def test_the_size_bound_evicts_the_least_recently_used(tmp_path):
    blocks = chain()
    tier = stored(tmp_path, blocks[:2], max_bytes=3 * BLOCK_FILE_BYTES)
    assert len(tier.load(hashes_of(blocks[:1]), ROOT_HASH)) == 1  # block 0 used last
    for block in blocks[2:]:
        tier.save(block)
    assert tier.wait_written(10)
    present = {h for h in hashes_of(blocks) if tier.has(h)}
    assert present == set(hashes_of([blocks[0], blocks[2], blocks[3]]))
    assert tier.num_bytes <= 3 * BLOCK_FILE_BYTES and tier.stats["evicted"] == 1
    assert len(list(tmp_path.glob("*.kv"))) == 3
    tier.close()


def test_entries_expire_after_the_ttl_unused(tmp_path):
    blocks = chain()
    now = [1000.0]
    tier = stored(tmp_path, blocks, ttl_s=60.0, clock=lambda: now[0])
    now[0] += 61
    assert tier.load(hashes_of(blocks), ROOT_HASH) == []
    assert not tier.has(blocks[0].block_hashes[0])
    tier.close()
    # At start, files unused for longer than the TTL (by their time) are removed.
    directory = tmp_path / "restarted"
    stored(directory, blocks).close()
    old = time.time() - 120
    for path in directory.glob("*.kv"):
        os.utime(path, (old, old))
    tier = open_tier(directory, ttl_s=60.0)
    assert tier.num_blocks == 0 and not list(directory.glob("*.kv"))
    tier.close()


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC, errno.EACCES])
def test_a_disk_that_refuses_writes_turns_the_tier_off_with_one_warning(
        tmp_path, monkeypatch, caplog, code):
    def refuse(*_args):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "replace", refuse)
    tier = open_tier(tmp_path)
    with caplog.at_level(logging.WARNING, logger="shoal.kv_disk"):
        tier.save(chain()[0])
        assert tier.wait_written(10)
        assert not tier.enabled
        assert not tier.save(chain()[1])
    warnings = [r for r in caplog.records if "is off" in r.getMessage()]
    assert len(warnings) == 1
    assert not list(tmp_path.iterdir())  # the temporary file went too
    tier.close()


def test_a_directory_that_cannot_be_made_turns_the_tier_off(tmp_path, caplog):
    blocker = tmp_path / "kv"
    blocker.write_text("a file where the tier's directory would go")
    with caplog.at_level(logging.WARNING, logger="shoal.kv_disk"):
        tier = open_tier(blocker / "model")
    assert not tier.enabled and not tier.save(chain()[0])
    assert tier.load(hashes_of(chain()), ROOT_HASH) == []
    assert any("is off" in r.getMessage() for r in caplog.records)
    tier.close()


def test_a_full_queue_drops_blocks_instead_of_waiting(tmp_path, monkeypatch):
    release = threading.Event()
    tier = open_tier(tmp_path, queue_blocks=1)
    writing = tier._write
    monkeypatch.setattr(tier, "_write", lambda block: (release.wait(10), writing(block)))
    blocks = chain()
    started = time.monotonic()
    results = [tier.save(block) for block in blocks]
    assert time.monotonic() - started < 1.0
    assert results[0] and not all(results) and tier.stats["dropped"] >= 1
    release.set()
    assert tier.wait_written(10)
    tier.close()


def test_a_slow_disk_costs_the_step_one_bound_and_then_nothing(tmp_path, monkeypatch):
    blocks = chain()
    tier = stored(tmp_path, blocks, read_timeout_s=0.2)
    release = threading.Event()
    reading = tier._read_chain
    monkeypatch.setattr(tier, "_read_chain",
                        lambda *args: (release.wait(10), reading(*args))[1])
    started = time.monotonic()
    assert tier.load(hashes_of(blocks), ROOT_HASH) == []
    assert time.monotonic() - started < 1.0 and tier.stats["read_timeouts"] == 1
    started = time.monotonic()
    assert tier.load(hashes_of(blocks), ROOT_HASH) == []  # the first read still hangs
    assert time.monotonic() - started < 0.1
    release.set()
    tier.close()


def run_prompt(scheduler, prefixes, request_id, prompt):
    """Drive one request to its end with a fake model (token 7 each step)."""
    from shoal.engine.request import Request
    from shoal.engine.sampling import SamplingParams

    scheduler.add(Request(request_id=request_id, prompt_token_ids=list(prompt),
                          params=SamplingParams(max_tokens=2, ignore_eos=True)))
    prefixes.arrived(request_id)
    admitted_with = None
    while scheduler.has_unfinished():
        prefixes.before_schedule()
        output = scheduler.schedule()
        if admitted_with is None:
            admitted_with = output.chunks[0].start_position
        scheduler.update(output, {c.request_id: 7 for c in output.chunks if c.needs_sample})
        prefixes.after_update()
    return admitted_with


class NoOtherRanks:
    """A model served whole: its blocks are this rank's alone (as LocalExecutor answers)."""

    def queue_saves(self, blocks):
        pass

    def agree_prefix(self, blocks, placed):
        return blocks.num_blocks


def engine_side(directory, seed):
    """A scheduler, a random 'computed' cache and the disk tier glue, as an engine has."""
    from shoal.engine.kv.disk_prefixes import DiskPrefixes
    from shoal.engine.kv.transfer import PrefixTransfer
    from shoal.engine.scheduler import Scheduler, SchedulerConfig

    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=BLOCK,
                                          max_num_batched_tokens=8, max_num_seqs=4,
                                          max_model_len=64, record_cached_blocks=True))
    generator = torch.Generator().manual_seed(seed)
    cache = [torch.randn((6, 16 * BLOCK, 8), generator=generator) for _ in range(2)]
    transfer = PrefixTransfer(scheduler.pool, lambda: cache, BLOCK)
    return scheduler, cache, DiskPrefixes(open_tier(directory), transfer, scheduler,
                                          NoOtherRanks())


def test_a_restarted_engine_admits_a_stored_prompt_with_its_blocks_computed(tmp_path):
    prompt = list(range(60, 74))  # 3 full blocks and 2 tokens more
    scheduler, cache, prefixes = engine_side(tmp_path, seed=1)
    assert run_prompt(scheduler, prefixes, "first", prompt) == 0
    hashes = extend_block_hashes([], prompt, BLOCK)
    original = [[t[:, b * BLOCK:(b + 1) * BLOCK].clone() for t in cache]
                for b in scheduler.pool.find_cached(hashes)]
    assert len(original) == 3
    prefixes.close()
    assert len(list(tmp_path.glob("*.kv"))) == 3

    scheduler, cache, prefixes = engine_side(tmp_path, seed=2)  # RAM empty, other values
    assert run_prompt(scheduler, prefixes, "again", prompt) == 3 * BLOCK
    assert prefixes.stats()["kv_disk_loaded_blocks"] == 3
    restored = scheduler.pool.find_cached(hashes)
    for block_id, tensors in zip(restored, original):
        for layer, expected in zip(cache, tensors):
            assert torch.equal(layer[:, block_id * BLOCK:(block_id + 1) * BLOCK], expected)
    prefixes.close()


class OtherRank:
    """The other rank of a split model, in this process: its own cache and RankTier,
    reached as rank 0's executor reaches it (queue_saves, agree_prefix)."""

    def __init__(self, directory, seed, forget=()):
        from shoal.engine.kv.disk_prefixes import RankTier

        generator = torch.Generator().manual_seed(seed)
        self.cache = [torch.randn((6, 16 * BLOCK, 8), generator=generator) for _ in range(2)]
        self.disk = RankTier(open_tier(directory), lambda: self.cache, BLOCK)
        self.forget = set(forget)  # block indices this rank's disk loses before a load
        self.placed: list[tuple[int, int]] = []

    def queue_saves(self, blocks):
        self.disk.save(blocks)

    def agree_prefix(self, blocks, placed):
        self.disk.tier.discard([blocks.block_hashes[i] for i in self.forget])
        self.placed = placed
        return self.disk.load(blocks.parent_hash, blocks.block_hashes, placed)


def test_a_split_model_loads_a_stored_prompt_only_as_far_as_every_rank_holds_it(tmp_path):
    from shoal.engine.kv.disk_prefixes import DiskPrefixes

    prompt = list(range(60, 78))  # 4 full blocks and 2 tokens more
    hashes = extend_block_hashes([], prompt, BLOCK)
    scheduler, cache, _ = engine_side(tmp_path / "rank0", seed=1)
    other = OtherRank(tmp_path / "rank1", seed=2)
    prefixes = DiskPrefixes(open_tier(tmp_path / "rank0"), PrefixTransfer(
        scheduler.pool, lambda: cache, BLOCK), scheduler, other)
    assert run_prompt(scheduler, prefixes, "first", prompt) == 0
    theirs = [[t[:, b * BLOCK:(b + 1) * BLOCK].clone() for t in other.cache]
              for b in scheduler.pool.find_cached(hashes)]
    prefixes.close()
    other.disk.close()
    assert len(list((tmp_path / "rank1").glob("*.kv"))) == 4  # the other rank saved its share

    # Restarted, the other rank's third block lost: only the two blocks both hold count,
    # and the other rank's share of them comes back from its own disk into rank 0's ids.
    scheduler, cache, _ = engine_side(tmp_path / "rank0", seed=3)
    other = OtherRank(tmp_path / "rank1", seed=4, forget=[2])
    prefixes = DiskPrefixes(open_tier(tmp_path / "rank0"), PrefixTransfer(
        scheduler.pool, lambda: cache, BLOCK), scheduler, other)
    assert run_prompt(scheduler, prefixes, "again", prompt) == 2 * BLOCK
    assert [index for index, _ in other.placed] == [0, 1, 2, 3]  # rank 0 had all four
    restored = scheduler.pool.find_cached(hashes)
    assert len(restored) >= 2
    for block_id, tensors in zip(restored[:2], theirs):
        for layer, expected in zip(other.cache, tensors):
            assert torch.equal(layer[:, block_id * BLOCK:(block_id + 1) * BLOCK], expected)
    prefixes.close()
    other.disk.close()
