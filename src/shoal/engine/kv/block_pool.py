"""A pool of KV blocks with reference counts, an LRU free list and a grant (pure Python).

A block is in use while some request references it (ref count > 0). When its last user lets
go, it joins the free list but keeps its prefix-cache entry, so a later request with the same
prefix can take it back without recomputing. Allocation takes free blocks in LRU order and
only then drops their cache entries (eviction).

The pool's blocks are address space (kv/tensors.py commits no page up front); a block's
memory becomes resident when it is first written. Blocks are first used in id order, so the
resident ones are always ids [0, num_touched_blocks). The grant bounds that: the pool never
touches more than granted_blocks, whatever its capacity, so what the runner holds grows only
as far as the node has agreed (runner/kv_grant.py asks for more). Allocation prefers a spent
block (resident, uncached), then a fresh one within the grant, then evicts a cached one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from shoal.engine.kv.prefix_cache import PrefixCache


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache = PrefixCache()
        self._ref_counts = [0] * num_blocks
        # Free resident blocks, spent (uncached) ones first, then cached ones least recently
        # freed first; values unused (an ordered set). Untouched blocks are not listed.
        self._free: OrderedDict[int, None] = OrderedDict()
        # Blocks ever allocated, ids [0, num_touched_blocks): their memory is resident; the
        # rest of the pool is reserved address space only.
        self.num_touched_blocks = 0
        # The most blocks the pool may touch (the node's grant); all of them until limited.
        self.granted_blocks = num_blocks
        # The most blocks an allocation lacked for want of a grant since the grant last
        # changed: what the next one should add at least.
        self.shortfall_blocks = 0
        self.num_evictions = 0

    # ---- queries ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free resident ones (cached ones are evictable) and
        untouched ones within the grant."""
        return len(self._free) + self._num_fresh_allowed

    @property
    def num_used_blocks(self) -> int:
        return self.num_touched_blocks - len(self._free)

    @property
    def _num_fresh_allowed(self) -> int:
        return min(self.granted_blocks, self.num_blocks) - self.num_touched_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks still holding a cached prefix (kept until allocation evicts them)."""
        return sum(1 for block_id in self.prefix_cache.block_ids() if block_id in self._free)

    @property
    def num_resident_free_blocks(self) -> int:
        """Free blocks whose memory is resident: cached prefixes, and spent blocks (a
        request's uncached tail) that the next allocation reuses first."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request."""
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        short = num_blocks - len(self._free) - self._num_fresh_allowed
        if short > 0 and self.granted_blocks < self.num_blocks:
            self.shortfall_blocks = max(self.shortfall_blocks, short)  # a grant would help
        return short <= 0

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    # ---- the grant -----------------------------------------------------------------------

    def set_grant(self, num_blocks: int) -> None:
        """Let the pool touch up to num_blocks blocks (within its capacity). A grant below
        what is already resident holds the pool where it is: touched pages stay."""
        if num_blocks < 0:
            raise ValueError("a KV grant must not be negative")
        self.granted_blocks = max(self.num_touched_blocks, min(num_blocks, self.num_blocks))
        self.shortfall_blocks = 0

    def release_free_tail(self, keep_blocks: int) -> range:
        """Give back the resident blocks above keep_blocks that no request holds, from the
        top down to the highest one in use: they leave the free list and the prefix cache,
        and the grant shrinks to what stays resident. Returns the ids given back (the caller
        hands their pages back to the system); they are touched afresh when needed again."""
        top = self.num_touched_blocks
        floor = max(1, keep_blocks)  # block 0 holds the zeroed slot that padding reads
        while top > floor and self._ref_counts[top - 1] == 0:
            top -= 1
        released = range(top, self.num_touched_blocks)
        for block_id in released:
            del self._free[block_id]
            if self.prefix_cache.hash_of(block_id) is not None:
                self.prefix_cache.forget(block_id)
        self.num_touched_blocks = top
        self.granted_blocks = min(self.granted_blocks, max(top, keep_blocks))
        return released

    # ---- allocation -----------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Take num_blocks fresh blocks (evicting cached free ones in LRU order)."""
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"cannot allocate {num_blocks} KV blocks: "
                               f"only {self.num_free_blocks} are free")
        taken = []
        for _ in range(num_blocks):
            block_id = self._take_one()
            self._ref_counts[block_id] = 1
            taken.append(block_id)
        return taken

    def _take_one(self) -> int:
        """A spent block, else a fresh one within the grant, else the LRU cached one."""
        spent = next(iter(self._free), None)
        if spent is not None and self.prefix_cache.hash_of(spent) is None:
            del self._free[spent]
            return spent
        if self._num_fresh_allowed > 0:
            self.num_touched_blocks += 1
            return self.num_touched_blocks - 1
        block_id, _ = self._free.popitem(last=False)
        if self.prefix_cache.hash_of(block_id) is not None:
            self.prefix_cache.forget(block_id)
            self.num_evictions += 1
        return block_id

    def find_cached(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Block ids holding the longest cached prefix of block_hashes (no references taken)."""
        if not self.enable_prefix_caching:
            return []
        return self.prefix_cache.lookup(block_hashes)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks found by find_cached (pulling free ones back)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Freed cached blocks stay findable; the request's
        tail goes to the free list first so a shared prefix outlives its suffixes."""
        for block_id in reversed(block_ids):
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"KV block {block_id} freed more often than allocated")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
                if self.prefix_cache.hash_of(block_id) is None:
                    # Uncached content is worthless: reuse this block before evicting any.
                    self._free.move_to_end(block_id, last=False)

    def cache_block(self, block_hash: bytes, block_id: int) -> bool:
        """Register a fully computed block under its chained hash. False when it was not
        (caching off, or the content is already cached in another block)."""
        return self.enable_prefix_caching and self.prefix_cache.insert(block_hash, block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after weights change); in-use blocks stay valid."""
        self.prefix_cache.clear()
