"""Which bytes of a GGUF model a pipeline or expert rank needs, read from the file's header
alone.

A rank holding layers [start, end) reads its layers' tensors ("blk.{i}."), the embedding on
the first rank (and on the last when the model ties its output head to it), the output head
on the last, and the small global tensors (norms, rope factors) everywhere: the engine's
own rule (engine/weights/names.in_stage), stated on GGUF names so that the node process
needs no torch. An expert rank holds every layer but only experts [first, last) of each
mixture-of-experts layer: a layer's experts are one tensor ("blk.{i}.ffn_up_exps.") whose
outermost dimension is the expert, so each expert's bytes are one contiguous slice of it,
and the rank reads only its slices. A rank's copy is the original file's layout with only
those ranges filled in (a sparse file: what it does not need is a hole), so it is a valid
GGUF that the engine reads exactly as the whole file for that rank.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from shoal.engine.errors import UnsupportedModel

_BLOCK = re.compile(r"^blk\.(\d+)\.")
_EXPERTS = re.compile(r"^blk\.\d+\.ffn_[a-z_]+_exps\.")  # [n_expert, ...] outermost
HEADER_GUESS_BYTES = 16 * 1024  # a GGUF header's first read (4x further until it parses)
# Copy the original's bytes [offset, offset + length) to the same place in the rank's file.
CopyRange = Callable[[int, int], Awaitable[None]]


# An expert rank's share: experts [first, last) of n_experts in each mixture-of-experts layer.
Experts = tuple[int, int, int]


async def copy_rank_share(path: Path, size: int, copy: CopyRange, start: int, end: int,
                          n_layers: int, experts: Experts | None = None) -> None:
    """Fill the rank's file at path (the original's size, sparse) with what layers
    [start, end) (and of their experts, `experts` only) need: the header first, read
    further until it parses within what was copied, then the tensors it lists for the
    rank. ValueError if the header never parses."""
    head = await copy_header(path, size, copy)
    for begin, length in await asyncio.to_thread(rank_ranges, path, start, end, n_layers,
                                                 experts):
        begin, length = max(begin, head), begin + length - max(begin, head)
        if length > 0:
            await copy(begin, length)


async def copy_header(path: Path, size: int, copy: CopyRange) -> int:
    """Fill the file at path (the original's size, sparse) with the GGUF's header (its
    metadata, the tokenizer included, and tensor index): a first guess, read further until
    it parses within what was copied. How many bytes from the start were copied; ValueError
    if the header never parses."""
    head, problem = min(size, HEADER_GUESS_BYTES), "it runs past the end of the file"
    while True:
        await copy(0, head)
        try:
            data_start = await asyncio.to_thread(header_bytes, path)
        except UnsupportedModel as error:
            data_start, problem = size + 1, str(error)
        # Past what was copied, the header was read from the hole's zeros: read further.
        if data_start <= head:
            break
        if head == size:
            raise ValueError(f"its GGUF header does not parse ({problem})")
        head = min(size, head * 4)
    return head


def rank_needs(name: str, start: int, end: int, n_layers: int, tied: bool) -> bool:
    """Whether the rank holding layers [start, end) of n_layers reads tensor `name`."""
    block = _BLOCK.match(name)
    if block is not None:
        return start <= int(block.group(1)) < end
    first, last = start == 0, end == n_layers
    if name.startswith("token_embd."):
        return first or (last and tied)
    if name.startswith("output."):
        return last
    return True  # output_norm, rope_freqs and the like: small


def rank_ranges(path: Path, start: int, end: int, n_layers: int,
                experts: Experts | None = None) -> list[tuple[int, int]]:
    """(offset, length) of the bytes the rank needs after the header, adjacent ranges
    merged, in file order. path: a file holding at least the GGUF's header (ValueError
    if it does not hold the whole header)."""
    # numpy and the gguf package: only on a node that copies a rank's share.
    from shoal.engine.weights.gguf_file import GGUFFile

    header = GGUFFile(path)
    tied = "output.weight" not in header.tensors
    needed = []
    for name, info in header.tensors.items():
        if rank_needs(name, start, end, n_layers, tied):
            needed.append(expert_slice(name, info.dims, info.offset, info.nbytes, experts))
    return _merged(sorted(needed))


def expert_slice(name: str, dims: tuple[int, ...], offset: int, nbytes: int,
                 experts: Experts | None) -> tuple[int, int]:
    """(offset, length) of a tensor's bytes an expert rank reads: its experts' slice of a
    layer's expert tensor (dims innermost first, the expert outermost), else all of it."""
    if experts is None or not _EXPERTS.match(name):
        return offset, nbytes
    first, last, n_experts = experts
    if not dims or dims[-1] != n_experts or nbytes % n_experts:
        return offset, nbytes  # not laid out one expert after another: read it whole
    per_expert = nbytes // n_experts
    return offset + first * per_expert, (last - first) * per_expert


def header_bytes(path: Path) -> int:
    """Where the tensor data of the GGUF at path starts (its header's length, aligned)."""
    from shoal.engine.weights.gguf_file import GGUFFile

    header = GGUFFile(path)
    return min((info.offset for info in header.tensors.values()), default=path.stat().st_size)


def _merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for offset, length in ranges:
        if merged and merged[-1][0] + merged[-1][1] >= offset:
            begin, size = merged[-1]
            merged[-1] = (begin, max(size, offset + length - begin))
        else:
            merged.append((offset, length))
    return merged
