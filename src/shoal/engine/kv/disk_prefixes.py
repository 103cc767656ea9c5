"""The engine's side of the SSD tier: save newly cached prompt blocks, load stored ones.

Saving: after each step the scheduler lists the prompt blocks it just registered; their KV is
copied to the CPU at once (the blocks may be reused by the next step) and queued for the
writer thread. Loading: when a request arrives, the blocks of its prompt that follow what the
RAM cache holds are read from disk (a bounded wait) and imported as cached blocks, so the
scheduler's ordinary prefix lookup admits the request with them already computed.

A tier is only valid for KV computed from the same weights, in the same dtypes, over the
same layer range and heads, with the same block size: all of that names its directory.

A model split over ranks keeps one tier per rank, each on its rank's own disk with that
rank's layers or heads: rank 0 saves its share and has the others save theirs (RankDisks,
the plan's `saved`); a stored prompt is loaded only as far as every rank holds it, each
rank into the block ids rank 0 chose (RankTier on the other ranks). A model served whole
is the case of no other ranks (LocalExecutor's RankDisks).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from shoal.engine.config import EngineConfig
from shoal.engine.kv.disk_tier import DiskTier
from shoal.engine.kv.prefix_cache import ROOT_HASH, CachedBlock, extend_block_hashes
from shoal.engine.kv.transfer import (
    Layout,
    PrefixBlocks,
    PrefixTransfer,
    TransferError,
    join_blocks,
    layout_of,
    pick_blocks,
    read_blocks,
    verify,
    write_blocks,
)
from shoal.engine.request import Request
from shoal.engine.scheduler import Scheduler

log = logging.getLogger("shoal.kv_disk")

# Bumped when what a block file holds changes meaning: old tiers are then left alone.
FORMAT_VERSION = 1
# Bytes hashed from each of a weights file's head, tail and evenly spread samples.
_SAMPLE_BYTES = 1 << 20
_SAMPLES = 8


def weights_fingerprint(path: Path) -> str:
    """A content hash of a weights file (or a directory's files): sizes, the head, the tail
    and a few samples between them. Equal files on two machines give equal fingerprints;
    hashing whole multi-GB files at every start would cost seconds."""
    digest = hashlib.blake2b(digest_size=16)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as handle:
            for index in range(_SAMPLES + 1):
                handle.seek(max(size - _SAMPLE_BYTES, 0) * index // _SAMPLES)
                digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def tier_directory(root: Path, model_id: str, identity: dict) -> Path:
    """root / "<model>-<hash of identity>": identity holds everything the KV depends on."""
    key = hashlib.blake2b(repr(sorted(identity.items())).encode(), digest_size=8).hexdigest()
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_id).strip("-")[:64] or "model"
    return root / f"{slug}-{key}"


def open_tier(config: EngineConfig, loaded, layout: Layout) -> DiskTier | None:
    """This rank's SSD tier, or None when --kv-disk (or prefix caching) is off."""
    disk = config.kv_disk
    if disk is None or not config.enable_prefix_caching:
        return None
    identity = {"format": FORMAT_VERSION,
                "weights": weights_fingerprint(Path(config.source.path)),
                "layers": tuple(loaded.layer_range),
                "compute": str(loaded.compute_dtype), "kv": str(loaded.cache_dtype),
                "block_size": config.block_size, "layout": layout}
    parallel = config.parallel
    if parallel is not None:  # tensor ranks hold other heads in caches of the same shape
        identity["shard"] = (parallel.tp_rank, parallel.tp_size)
    directory = tier_directory(Path(disk.root), config.source.model_id, identity)
    tier = DiskTier(directory, disk.max_bytes, disk.ttl_s, config.block_size,
                    read_timeout_s=disk.read_timeout_s)
    log.info("KV disk tier at %s: %d blocks, %.1f of %.1f MiB", directory, tier.num_blocks,
             tier.num_bytes / 2**20, disk.max_bytes / 2**20)
    return tier


class RankDisks(Protocol):
    """Rank 0's way to the other ranks' tiers (parallel/executor.py: LeaderExecutor, or
    LocalExecutor for a model served whole, which has none)."""

    def queue_saves(self, blocks: Sequence[CachedBlock]) -> None: ...

    def agree_prefix(self, blocks: PrefixBlocks, placed: list[tuple[int, int]]) -> int: ...


def open_disk_prefixes(config: EngineConfig, loaded, transfer: PrefixTransfer,
                       scheduler: Scheduler, ranks: RankDisks) -> DiskPrefixes | None:
    """The engine's SSD tier, or None when --kv-disk is off (or prefix caching is). ranks:
    the other ranks' tiers (none for a model served whole)."""
    tier = open_tier(config, loaded, transfer.layout)
    return None if tier is None else DiskPrefixes(tier, transfer, scheduler, ranks)


class DiskPrefixes:
    """Connects one engine's scheduler and cache to its DiskTier."""

    def __init__(self, tier: DiskTier, transfer: PrefixTransfer, scheduler: Scheduler,
                 ranks: RankDisks) -> None:
        self.tier = tier
        self._own = RankTier(tier, transfer.cache, transfer.block_size)
        self._transfer = transfer
        self._scheduler = scheduler
        self._ranks = ranks
        self._arrived: list[str] = []

    def arrived(self, request_id: str) -> None:
        """A new request: its prefix is looked up on disk before the next schedule."""
        self._arrived.append(request_id)

    def before_schedule(self) -> None:
        """Load the new requests' stored prefixes: all of them within one read bound."""
        arrived, self._arrived = self._arrived, []
        deadline = time.monotonic() + self.tier.read_timeout_s
        for request_id in arrived:
            request = self._scheduler.get(request_id)
            if request is not None and request.num_computed_tokens == 0:
                self.load(request, deadline - time.monotonic())

    def after_update(self) -> None:
        """Queue the prompt blocks registered in this step (a copy each, made now; the
        other ranks copy theirs before the next step runs)."""
        blocks = self._scheduler.drain_cached_blocks()
        if blocks:
            self._own.save(blocks)
            self._ranks.queue_saves(blocks)

    def load(self, request: Request, timeout_s: float | None = None) -> int:
        """Import the request's stored prompt blocks beyond those in RAM; how many."""
        size = self._scheduler.block_size
        prompt = request.prompt_token_ids
        # The last prompt token is always computed (its logits are sampled).
        hashes = extend_block_hashes([], prompt, size)[:(len(prompt) - 1) // size]
        in_ram = self._scheduler.pool.find_cached(hashes)
        rest = hashes[len(in_ram):]
        if not rest or not self.tier.has(rest[0]):
            return 0
        parent = hashes[len(in_ram) - 1] if in_ram else ROOT_HASH
        loaded = self.tier.load(rest, parent, timeout_s)
        if not loaded:
            return 0
        blocks = join_blocks(loaded)
        try:
            return self._transfer.import_(blocks, keep=in_ram, agree=self._ranks.agree_prefix)
        except TransferError as error:
            log.warning("stored KV blocks do not fit this model's cache (%s); removed", error)
            self.tier.discard(blocks.block_hashes)
            return 0

    def stats(self) -> dict:
        tier = self.tier
        return {"kv_disk_enabled": tier.enabled, "kv_disk_blocks": tier.num_blocks,
                "kv_disk_bytes": tier.num_bytes,
                **{f"kv_disk_{name}_blocks": count for name, count in tier.stats.items()
                   if name != "read_timeouts"},
                "kv_disk_read_timeouts": tier.stats["read_timeouts"]}

    def close(self) -> None:
        self._own.close()


class RankTier:
    """One rank's share of each prefix block, on its own disk: it saves the blocks rank 0
    lists and (on the other ranks of a split model) loads the ones rank 0 asks for."""

    def __init__(self, tier: DiskTier, cache: Callable[[], list[torch.Tensor]],
                 block_size: int) -> None:
        self.tier = tier
        self._cache = cache
        self._block_size = block_size

    def save(self, blocks: Sequence[CachedBlock]) -> None:
        """Queue this rank's KV of the given blocks (as they are now, before the next step)."""
        for block in blocks:
            if self.tier.enabled and not self.tier.has(block.block_hash):
                self.tier.save(PrefixBlocks(
                    block.parent_hash, block.token_ids, (block.block_hash,),
                    read_blocks(self._cache(), [block.block_id], self._block_size),
                    self._block_size))

    def load(self, parent_hash: bytes, block_hashes: Sequence[bytes],
             placed: Sequence[tuple[int, int]]) -> int:
        """Load the stored run of block_hashes (a bounded wait) and write each placed
        (index, block id) it covers; how many leading blocks it covers."""
        if not block_hashes:
            return 0
        loaded = self.tier.load(block_hashes, parent_hash)
        if not loaded:
            return 0
        blocks = join_blocks(loaded)
        try:
            verify(blocks, layout_of(self._cache()), self._block_size)
        except TransferError as error:
            log.warning("stored KV blocks do not fit this rank's cache (%s); removed", error)
            self.tier.discard(blocks.block_hashes)
            return 0
        count = blocks.num_blocks
        covered = [(index, block_id) for index, block_id in placed if index < count]
        if covered:
            write_blocks(self._cache(), [block_id for _, block_id in covered],
                         self._block_size, pick_blocks(blocks, [index for index, _ in covered]))
        return count

    def close(self) -> None:
        # Within the supervisor's grace for a runner asked to shut down (5 s).
        self.tier.close(flush_timeout_s=3.0)


def open_rank_tier(config: EngineConfig, loaded,
                   cache: Callable[[], list[torch.Tensor]]) -> RankTier | None:
    tier = open_tier(config, loaded, layout_of(cache()))
    return None if tier is None else RankTier(tier, cache, config.block_size)
