"""Tensor-parallel slices of checkpoint tensors, taken before any conversion.

A tensor rank keeps its share of each layer: whole KV-head groups (a KV head with the q
heads that read it) split as evenly as the group count allows, or, with fewer KV heads than
ranks, one replicated KV head and an equal part of its q heads; the matching columns of the
output projection; and an equal part of the MLP's intermediate columns. Shares are uneven
when the counts do not divide (SmolLM2's 9 heads in 3 groups over 2 ranks: 6 and 3), which
keeps every attention head whole and every result exact. Column-parallel weights (q, k, v,
gate, up) lose rows; row-parallel ones (o, down) lose columns, and their partial outputs are
summed across the ranks.

Slices are taken on the stored bytes: rows of any tensor, and columns of a quantized one
when the cut falls on its block boundary (32 weights for Q4/Q8, 256 for K-quants), so 4-bit
weights stay 4-bit. A cut inside a block dequantizes that tensor first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shoal.engine.weights.quant import RawTensor


@dataclass(frozen=True)
class TensorShard:
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor rank {self.rank} of {self.size}")

    def split(self, total: int, what: str) -> tuple[int, int]:
        """This rank's [start, end) of total items in near-equal parts (the first ranks take
        one more when it does not divide); ValueError if some rank would get none."""
        if total < self.size:
            raise ValueError(f"{what} ({total}) is fewer than {self.size} tensor ranks")
        base, extra = divmod(total, self.size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (1 if self.rank < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    """The heads one tensor rank computes: q heads [q_start, q_end), KV heads [kv_start,
    kv_end) (a replicated head when KV heads are fewer than ranks)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start


def head_shard(num_heads: int, num_kv_heads: int, shard: TensorShard) -> HeadShard:
    group = num_heads // num_kv_heads  # q heads per KV head
    if num_kv_heads >= shard.size:
        kv_start, kv_end = shard.split(num_kv_heads, "KV heads")
        return HeadShard(kv_start * group, kv_end * group, kv_start, kv_end)
    sharing = shard.size // num_kv_heads  # ranks that replicate one KV head
    if shard.size % num_kv_heads or group % sharing:
        raise ValueError(f"{num_heads} heads in {num_kv_heads} KV groups cannot be split "
                         f"over {shard.size} tensor ranks")
    kv = shard.rank // sharing
    part = group // sharing
    q_start = kv * group + (shard.rank % sharing) * part
    return HeadShard(q_start, q_start + part, kv, kv + 1)


def take_rows(raw: RawTensor, start: int, end: int) -> RawTensor:
    """Rows [start, end) (output features); exact for every storage type."""
    if not 0 <= start < end <= raw.shape[0]:
        raise ValueError(f"rows [{start}, {end}) outside {raw.shape}")
    shape = (end - start, *raw.shape[1:])
    return RawTensor(shape, raw.quant, raw.data[start:end])


def take_columns(raw: RawTensor, start: int, end: int) -> RawTensor:
    """Columns [start, end) (input features) of a matrix; stays quantized when the cut is on
    block boundaries, else becomes a dense float32 tensor."""
    rows, cols = raw.shape
    if not 0 <= start < end <= cols:
        raise ValueError(f"columns [{start}, {end}) outside {raw.shape}")
    if raw.quant == "dense":
        return RawTensor((rows, end - start), "dense", raw.data[:, start:end])
    block = _block(raw.quant)
    if block is not None and start % block[0] == 0 and end % block[0] == 0:
        weights, nbytes = block
        stored = np.asarray(raw.data).reshape(rows, -1)
        cut = stored[:, start // weights * nbytes:end // weights * nbytes]
        return RawTensor((rows, end - start), raw.quant, np.ascontiguousarray(cut))
    dense = raw.dequantize()[:, start:end].contiguous()
    return RawTensor((rows, end - start), "dense", dense)


def _block(quant: str) -> tuple[int, int] | None:
    """(weights per block, bytes per block) of a GGML type; None if not a GGML type."""
    import gguf

    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[quant]]
    except KeyError:
        return None


def take_vector(raw: RawTensor, start: int, end: int) -> RawTensor:
    """Entries [start, end) of a bias vector."""
    values = raw.dequantize()[start:end].contiguous()
    return RawTensor(tuple(values.shape), "dense", values)


def dense(tensor: torch.Tensor) -> RawTensor:
    return RawTensor(tuple(tensor.shape), "dense", tensor)
