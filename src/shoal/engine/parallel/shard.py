"""Tensor-parallel slices of checkpoint tensors, taken before any conversion.

A tensor rank keeps 1/tp of each layer: the q heads [r*Hq/tp, (r+1)*Hq/tp) with the KV
heads they read (a share of the KV heads, or one replicated head when there are fewer KV
heads than ranks), the matching columns of the output projection, and 1/tp of the MLP's
intermediate columns. Column-parallel weights (q, k, v, gate, up) lose rows; row-parallel
ones (o, down) lose columns, and their partial outputs are summed across the ranks.

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
        """This rank's [start, end) of `total` equal parts (ValueError if uneven)."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) does not divide by {self.size} tensor ranks")
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part


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
    q_start, q_end = shard.split(num_heads, "attention heads")
    if num_kv_heads % shard.size == 0:
        kv_start, kv_end = shard.split(num_kv_heads, "KV heads")
    elif shard.size % num_kv_heads == 0:
        group = num_heads // num_kv_heads  # q heads per KV head
        kv_start = q_start // group
        kv_end = kv_start + 1
        if (q_end - 1) // group != kv_start:
            raise ValueError(f"{num_heads} heads over {shard.size} ranks straddle KV heads")
    else:
        raise ValueError(f"{num_kv_heads} KV heads neither divide by nor replicate evenly "
                         f"over {shard.size} tensor ranks")
    return HeadShard(q_start, q_end, kv_start, kv_end)


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
