"""The int8 KV cache (--kv-cache-dtype int8): scales per token, head and 16 channels.

A cache row (one token's key or value of one KV head) is D int8 values followed by one bf16
scale per group of GROUP consecutive channels (a single group when D is not a multiple of
GROUP), in the same int8 tensor: [2 * H_kv, slots, D + D / 8]: 56% of a bf16 row. Keeping
the scales in the row keeps one tensor per layer, so whatever moves cache rows (the decode
row buffer, index_copy_ writes, copies of blocks) moves the scales with them, and the compiled
kernels find a row's scales in the cache line after its values. Quantization is symmetric
absmax per group: scale = bf16(max |x| / 127), q = round(x / scale) (half to even, clamped
to +-127), value = q * scale.

Why groups of 16 with bf16 scales rather than one float32 scale per row (53%): Qwen2.5's
keys carry a few large channels (its k bias), which, sharing a scale with the whole row,
left the others a handful of levels. On a fixed 250-token text with bf16 compute its loss
rose 0.044 nats with one scale per row, 0.035 with float32 scales per 32 channels and not
measurably with scales per 16 (a scale rounded to bf16 is off by at most 0.4%, a smaller
error than a level of the values it scales). The compiled kernels (kernels/kv_layout.h)
quantize with the same float32 operations, so a row written by either path has the same
bits.
"""

from __future__ import annotations

import torch

GROUP = 16  # channels per scale
SCALE_BYTES = 2  # a bf16 scale
LEVELS = 127.0  # symmetric: -127 .. 127


def group_size(head_dim: int) -> int:
    return GROUP if head_dim % GROUP == 0 else head_dim


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cache row: D, or D int8 values and their scales' bytes."""
    if dtype != torch.int8:
        return head_dim
    return head_dim + SCALE_BYTES * (head_dim // group_size(head_dim))


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's key (or value) of one KV head in a cache of dtype."""
    return row_width(head_dim, dtype) * torch.empty((), dtype=dtype).element_size()


def check_head_dim(head_dim: int) -> None:
    """The scales are read as a bf16 view of each row's last bytes: rows (and so D) must
    keep them 2-byte aligned."""
    if head_dim % SCALE_BYTES:
        raise ValueError(f"an int8 KV cache needs an even head size, not {head_dim}")


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x: [..., D] float -> [..., W] int8 rows (values, then each group's bf16 scale)."""
    head_dim = x.shape[-1]
    group = group_size(head_dim)
    x = x.float().unflatten(-1, (head_dim // group, group))  # [..., G, group]
    scale = (x.abs().amax(dim=-1, keepdim=True) / LEVELS).to(torch.bfloat16)  # [..., G, 1]
    # A group of zeros has scale 0: divide by 1 instead, its values are 0 either way.
    divisor = torch.where(scale > 0, scale.float(), 1.0)
    values = torch.round(x / divisor).clamp_(-LEVELS, LEVELS).to(torch.int8).flatten(-2)
    return torch.cat((values, scale.squeeze(-1).contiguous().view(torch.int8)), dim=-1)


def dequantize(rows: torch.Tensor, head_dim: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., W] int8 rows -> [..., D] in dtype (the few rows one attention reads)."""
    group = group_size(head_dim)
    scale = rows[..., head_dim:].view(torch.bfloat16).unsqueeze(-1).float()  # [..., G, 1]
    values = rows[..., :head_dim].to(torch.float32).unflatten(-1, (head_dim // group, group))
    return (values * scale).flatten(-2).to(dtype)


def stored(kv: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """New keys / values [..., D] as a cache of cache_dtype holds them."""
    if kv.dtype == cache_dtype:
        return kv
    return quantize(kv) if cache_dtype == torch.int8 else kv.to(cache_dtype)


def widened(kv: torch.Tensor, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
    """Rows read from the cache as values of dtype ([..., W] int8 -> [..., D])."""
    if kv.dtype == dtype:
        return kv
    return dequantize(kv, head_dim, dtype) if kv.dtype == torch.int8 else kv.to(dtype)
