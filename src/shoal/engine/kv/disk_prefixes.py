"""The engine's side of the SSD tier: save newly cached prompt blocks, load stored ones.

Saving: after each step the scheduler lists the prompt blocks it just registered; their KV is
copied to the CPU at once (the blocks may be reused by the next step) and queued for the
writer thread. Loading: when a request arrives, the blocks of its prompt that follow what the
RAM cache holds are read from disk (a bounded wait) and imported as cached blocks, so the
scheduler's ordinary prefix lookup admits the request with them already computed.

A tier is only valid for KV computed from the same weights, in the same dtypes, over the
same layer range and heads, with the same block size: all of that names its directory.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from pathlib import Path

from shoal.engine.config import EngineConfig
from shoal.engine.kv.disk_tier import DiskTier
from shoal.engine.kv.prefix_cache import ROOT_HASH, extend_block_hashes
from shoal.engine.kv.transfer import PrefixTransfer, TransferError, join_blocks
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


def open_disk_prefixes(config: EngineConfig, loaded, transfer: PrefixTransfer,
                       scheduler: Scheduler) -> DiskPrefixes | None:
    """The engine's SSD tier, or None when --kv-disk is off (or prefix caching is, or the
    model is split across ranks: every rank would have to load its share in step)."""
    disk = config.kv_disk
    if disk is None or config.parallel is not None or not config.enable_prefix_caching:
        return None
    identity = {"format": FORMAT_VERSION,
                "weights": weights_fingerprint(Path(config.source.path)),
                "layers": tuple(loaded.layer_range),
                "compute": str(loaded.compute_dtype), "kv": str(loaded.cache_dtype),
                "block_size": config.block_size, "layout": transfer.layout}
    directory = tier_directory(Path(disk.root), config.source.model_id, identity)
    tier = DiskTier(directory, disk.max_bytes, disk.ttl_s, config.block_size,
                    read_timeout_s=disk.read_timeout_s)
    log.info("KV disk tier at %s: %d blocks, %.1f of %.1f MiB", directory, tier.num_blocks,
             tier.num_bytes / 2**20, disk.max_bytes / 2**20)
    return DiskPrefixes(tier, transfer, scheduler)


class DiskPrefixes:
    """Connects one engine's scheduler and cache to its DiskTier."""

    def __init__(self, tier: DiskTier, transfer: PrefixTransfer, scheduler: Scheduler) -> None:
        self.tier = tier
        self._transfer = transfer
        self._scheduler = scheduler
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
        """Queue the prompt blocks registered in this step (a copy each, made now)."""
        for block in self._scheduler.drain_cached_blocks():
            if self.tier.enabled and not self.tier.has(block.block_hash):
                self.tier.save(self._transfer.export_block(
                    block.block_id, block.parent_hash, block.block_hash, block.token_ids))

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
            return self._transfer.import_(blocks, keep=in_ram)
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
        # Within the supervisor's grace for a runner asked to shut down (5 s).
        self.tier.close(flush_timeout_s=3.0)
