"""Content-addressed index of full KV blocks (pure Python; no torch).

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal
whole prefixes, not just equal blocks. Only full blocks are hashed: a partial block's content
still changes. The cache maps hashes to block ids; which blocks are free and which get evicted
is the block pool's business (it calls `forget` when it reuses a block).

The cache also keeps a journal of the hashes it gained and lost since it was last drained
(`drain_changes`), so the runner can tell the cluster which prefixes it holds in batches. The
journal nets out (a hash stored then dropped in one batch is reported not at all), so it
never holds more than twice the number of blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

# The parent of a request's first block.
ROOT_HASH = b"shoal-prefix-root"


def hash_block(parent_hash: bytes, token_ids: Sequence[int], generated: bool = False) -> bytes:
    """Chained hash of one full block. 128-bit blake2b makes a collision (which would serve
    another prompt's KV) practically impossible, unlike Python's 64-bit hash().

    generated: the block holds generated tokens, whose KV the engine computes another way
    than a prompt's (the decode kernel; kernels/quant.h): such a block never stands in for
    the same tokens met in a later prompt, whose result must not depend on the cache."""
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    if generated:
        digest.update(b"generated")
    return digest.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        prompt_len: int | None = None) -> list[bytes]:
    """Append hashes for the full blocks of token_ids not yet hashed; returns `hashes`.

    `hashes` holds the hashes of the first len(hashes) blocks, so a growing request pays
    only for its newly full blocks. Blocks reaching past prompt_len (None: the whole list
    is prompt) hold generated tokens and hash apart (hash_block).
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    num_full = len(token_ids) // block_size
    limit = len(token_ids) if prompt_len is None else prompt_len
    parent = hashes[-1] if hashes else ROOT_HASH
    for index in range(len(hashes), num_full):
        block = token_ids[index * block_size:(index + 1) * block_size]
        parent = hash_block(parent, block, generated=(index + 1) * block_size > limit)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class CachedBlock:
    """A prompt block just registered: where its KV sits and the chain it belongs to."""

    block_id: int
    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]


class PrefixCache:
    """Maps the hash of a computed full block to the block id holding its KV entries."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        # Counted in tokens, per admission lookup (vLLM reports the same pair).
        self.query_tokens = 0
        self.hit_tokens = 0
        self.hit_requests = 0
        # Since the last drain: hashes gained, and hashes lost that were held at that drain.
        self._stored: set[bytes] = set()
        self._removed: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._block_of)

    def lookup(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of block_hashes (stops at the first miss)."""
        found: list[int] = []
        for block_hash in block_hashes:
            block_id = self._block_of.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_query_tokens
        self.hit_tokens += num_hit_tokens
        if num_hit_tokens:
            self.hit_requests += 1

    def insert(self, block_hash: bytes, block_id: int) -> bool:
        """Register a computed block. Returns False when the content is already cached in
        another block (two requests computed the same prefix at once); that block stays
        the canonical copy and this one remains uncached."""
        if block_hash in self._block_of or block_id in self._hash_of:
            return False
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        if block_hash in self._removed:
            self._removed.discard(block_hash)  # lost and regained: no change to report
        else:
            self._stored.add(block_hash)
        return True

    def block_ids(self):
        """The ids of the blocks that hold cached content."""
        return self._hash_of.keys()

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hash_of.get(block_id)

    def forget(self, block_id: int) -> None:
        """Drop a block from the index (it is about to hold other content)."""
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            del self._block_of[block_hash]
            self._journal_removal(block_hash)

    def clear(self) -> None:
        for block_hash in self._block_of:
            self._journal_removal(block_hash)
        self._block_of.clear()
        self._hash_of.clear()

    def _journal_removal(self, block_hash: bytes) -> None:
        if block_hash in self._stored:
            self._stored.discard(block_hash)  # gained and lost within one batch
        else:
            self._removed.add(block_hash)

    @property
    def has_changes(self) -> bool:
        return bool(self._stored or self._removed)

    def drain_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(hashes stored, hashes removed) since the last drain, and start a new batch."""
        stored, removed = list(self._stored), list(self._removed)
        self._stored.clear()
        self._removed.clear()
        return stored, removed
