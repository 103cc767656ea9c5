"""Paged KV cache tensors: per layer, K and V of shape [num_blocks * block_size, H_kv, D]."""

from __future__ import annotations

import torch

from shoal.engine.models.config import ModelConfig


def allocate_kv_cache(config: ModelConfig, num_layers: int, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device | str = "cpu",
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k, v) pair per local layer; slot = block_id * block_size + offset in block."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError("num_blocks and block_size must be >= 1")
    shape = (num_blocks * block_size, config.num_kv_heads, config.head_dim)
    # zeros, not empty: padded gathers read slot 0 and must never see NaN garbage.
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]
