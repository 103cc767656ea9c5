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
    return [(_lazy_cache(shape, dtype, device), _lazy_cache(shape, dtype, device))
            for _ in range(num_layers)]


def _lazy_cache(shape: tuple[int, int, int], dtype: torch.dtype,
                device: torch.device | str) -> torch.Tensor:
    """Uncommitted memory (pages arrive as blocks are first written), slot 0 zeroed.

    Padded gathers read slot 0 and must never see NaN garbage; every other slot that is
    read has been written first. torch.zeros would commit the whole budget at start-up.
    """
    cache = torch.empty(shape, dtype=dtype, device=device)
    cache[0].zero_()
    return cache
