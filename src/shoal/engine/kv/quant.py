"""The int8 KV cache (--kv-cache-dtype int8): one scale per token and head.

A cache row (one token's key or value of one KV head) is D int8 values followed by its
float32 scale, 4 bytes, in the same int8 tensor: [2 * H_kv, slots, D + 4]. Keeping the scale
in the row keeps one tensor per layer, so whatever moves cache rows (the decode stage,
index_copy_ writes, copies of blocks) moves the scales with them, and the compiled kernels
find a row's scale in the cache line after its values. Quantization is symmetric absmax:
scale = max |x| / 127, q = round(x / scale) (half to even), value = q * scale. The compiled
kernels (kernels/kv_layout.h) quantize with the same float32 operations, so a row written by
either path has the same bits.
"""

from __future__ import annotations

import torch

# Bytes of a row's scale (float32) after its D int8 values.
SCALE_BYTES = 4
LEVELS = 127.0  # symmetric: -127 .. 127


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cache row: D, or D int8 values and the scale's bytes."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's key (or value) of one KV head in a cache of dtype."""
    return row_width(head_dim, dtype) * torch.empty((), dtype=dtype).element_size()


def check_head_dim(head_dim: int) -> None:
    """The scale is read as a float32 view of each row's last 4 bytes: rows (and so D)
    must keep it 4-byte aligned."""
    if head_dim % SCALE_BYTES:
        raise ValueError(f"an int8 KV cache needs a head size that is a multiple of 4, "
                         f"not {head_dim}")


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x: [..., D] float -> [..., D + 4] int8 rows (values, then the float32 scale)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / LEVELS  # [..., 1]
    # A row of zeros has scale 0: divide by 1 instead, its values are 0 either way.
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = torch.round(x / divisor).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return torch.cat((values, scale.view(torch.int8)), dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + 4] int8 rows -> [..., D] in dtype (the few rows one attention reads)."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].view(torch.float32)  # [..., 1]
    return (rows[..., :head_dim].to(torch.float32) * scale).to(dtype)


def stored(kv: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """New keys / values [..., D] as a cache of cache_dtype holds them."""
    if kv.dtype == cache_dtype:
        return kv
    return quantize(kv) if cache_dtype == torch.int8 else kv.to(cache_dtype)


def widened(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from the cache as values of dtype ([..., D + 4] int8 -> [..., D])."""
    if kv.dtype == dtype:
        return kv
    return dequantize(kv, dtype) if kv.dtype == torch.int8 else kv.to(dtype)
