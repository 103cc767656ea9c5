"""Paged KV cache tensors: per layer one tensor [2 * H_kv, num_blocks * block_size, W]:
W = D elements, or for an int8 cache D values and their scale's 4 bytes (kv/quant.py).

Rows 0 .. H_kv - 1 hold keys and rows H_kv .. 2 H_kv - 1 values, so a layer writes a token's
k and v with one index_copy_ and reads them with one index_select (half the small ops of
separate K and V tensors, which matters at batch-1 decode). Head-major: each head's keys
over consecutive slots are one contiguous [L, D] slab, which attention reads fastest (about
twice as fast at batch-1 decode as a slot-major [slots, 2 * H_kv, D] cache).
"""

from __future__ import annotations

import torch

from shoal.engine.kv.quant import row_width
from shoal.engine.models.config import ModelConfig


def allocate_kv_cache(config: ModelConfig, num_layers: int, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device | str = "cpu",
                      row_buffer_slots: int = 0) -> list[torch.Tensor]:
    """One [2 * H_kv, slots, W] tensor per local layer; slot = block_id * block_size + offset.

    row_buffer_slots more slots follow the paged blocks: the decode row buffer
    (kv/row_buffer.py).
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError("num_blocks and block_size must be >= 1")
    if row_buffer_slots < 0:
        raise ValueError("row_buffer_slots must be >= 0")
    shape = (2 * config.num_kv_heads, num_blocks * block_size + row_buffer_slots,
             row_width(config.head_dim, dtype))
    return [_lazy_cache(shape, dtype, device) for _ in range(num_layers)]


def _lazy_cache(shape: tuple[int, int, int], dtype: torch.dtype,
                device: torch.device | str) -> torch.Tensor:
    """Uncommitted memory (pages arrive as blocks are first written), slot 0 zeroed.

    Padded gathers read slot 0 and must never see NaN garbage (an int8 row of zeros has
    scale 0); every other slot that is read has been written first. torch.zeros would
    commit the whole budget at start-up.
    """
    cache = torch.empty(shape, dtype=dtype, device=device)
    cache[:, 0].zero_()
    return cache
