"""Prefix blocks (engine/kv/transfer.py) as msgpack-able dicts, and cut into parts.

A part is {"parent", "tokens", "hashes", "block_size", "tensors": [{"dtype", "shape",
"data"}]}: the raw bytes of each cache tensor's slots ([dim 0, n * block_size, *rest]),
so the node processes that carry it between runners never need torch. Only runners import
this module.
"""

from __future__ import annotations

from array import array
from typing import Any

from shoal.engine.kv.transfer import (
    PrefixBlocks,
    TransferError,
    tensor_from_wire,
    tensor_to_wire,
)

# Tensor bytes per part: a frame (runner/framing.py, 16 MiB) holds one with room to spare.
PART_BYTES = 8 * 1024 * 1024


def blocks_to_wire(blocks: PrefixBlocks) -> dict[str, Any]:
    return {"parent": blocks.parent_hash,
            "tokens": array("i", blocks.token_ids).tobytes(),
            "hashes": list(blocks.block_hashes), "block_size": blocks.block_size,
            "tensors": [tensor_to_wire(t) for t in blocks.tensors]}


def blocks_from_wire(wire: dict[str, Any]) -> PrefixBlocks:
    """TransferError for a malformed part (the import then verifies its content)."""
    try:
        tensors = [tensor_from_wire(spec) for spec in wire["tensors"]]
        tokens = array("i")
        tokens.frombytes(wire["tokens"])
        return PrefixBlocks(bytes(wire["parent"]), tuple(tokens),
                            tuple(bytes(h) for h in wire["hashes"]), tuple(tensors),
                            int(wire["block_size"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise TransferError(f"malformed prefix blocks: {error}") from None


def slice_blocks(blocks: PrefixBlocks, start: int, end: int) -> PrefixBlocks:
    """Blocks [start, end) of blocks (views, no copy)."""
    size = blocks.block_size
    parent = blocks.parent_hash if start == 0 else blocks.block_hashes[start - 1]
    return PrefixBlocks(parent, blocks.token_ids[start * size:end * size],
                        blocks.block_hashes[start:end],
                        tuple(t.narrow(1, start * size, (end - start) * size)
                              for t in blocks.tensors), size)


def split_blocks(blocks: PrefixBlocks, start: int = 0,
                 part_bytes: int = PART_BYTES) -> list[PrefixBlocks]:
    """Blocks from start on, as consecutive parts of at most part_bytes of tensors each
    (at least one block per part)."""
    per_block = sum(t.element_size() * t.numel() for t in blocks.tensors) \
        // max(1, blocks.num_blocks)
    step = max(1, part_bytes // max(1, per_block))
    return [slice_blocks(blocks, first, min(first + step, blocks.num_blocks))
            for first in range(start, blocks.num_blocks, step)]
