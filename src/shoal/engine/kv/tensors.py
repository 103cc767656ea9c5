"""Paged KV cache tensors: per layer one tensor [2 * H_kv, num_blocks * block_size, W]:
W = D elements, or for an int8 cache D values and their scales' bytes (kv/quant.py).
Latent attention (DeepSeek, models/deepseek2.py) caches one row per token instead,
[1, slots, W] with D = kv_lora_rank + rope: keys read all of it, values its first
kv_lora_rank elements (ModelConfig.kv_cache_rows, kv_row_dim).

Rows 0 .. H_kv - 1 hold keys and rows H_kv .. 2 H_kv - 1 values, so a layer writes a token's
k and v with one index_copy_ and reads them with one index_select (half the small ops of
separate K and V tensors, which matters at batch-1 decode). Head-major: each head's keys
over consecutive slots are one contiguous [L, D] slab, which attention reads fastest (about
twice as fast at batch-1 decode as a slot-major [slots, 2 * H_kv, D] cache).
"""

from __future__ import annotations

import ctypes
import mmap

import torch

from shoal.engine.kv.quant import row_width
from shoal.engine.models.config import ModelConfig


def allocate_kv_cache(config: ModelConfig, num_layers: int, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device | str = "cpu",
                      row_buffer_slots: int = 0) -> list[torch.Tensor]:
    """One [rows, slots, W] tensor per local layer (rows = 2 * H_kv, or 1 for latent
    attention); slot = block_id * block_size + offset.

    row_buffer_slots more slots follow the paged blocks: the decode row buffer
    (kv/row_buffer.py).
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError("num_blocks and block_size must be >= 1")
    if row_buffer_slots < 0:
        raise ValueError("row_buffer_slots must be >= 0")
    shape = (config.kv_cache_rows, num_blocks * block_size + row_buffer_slots,
             row_width(config.kv_row_dim, dtype))
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


_MADV_DONTNEED = 4  # Linux: the pages read back as zeros, their memory is freed now


def release_slots(caches: list[torch.Tensor], first_slot: int, end_slot: int) -> int:
    """Hand the pages of slots [first_slot, end_slot) of every [rows, slots, W] cache tensor
    back to the system (they come back zeroed when next written). Only whole pages inside
    each row's range go; a CPU tensor on Linux only (elsewhere nothing is released).
    Returns the bytes released."""
    madvise = _madvise()
    if madvise is None or end_slot <= first_slot:
        return 0
    page = mmap.PAGESIZE
    released = 0
    for cache in caches:
        if cache.device.type != "cpu" or not cache.is_contiguous():
            continue
        rows, slots = cache.shape[0], cache.shape[1]
        slot_bytes = cache.stride(1) * cache.element_size()
        for row in range(rows):
            row_start = cache.data_ptr() + row * slots * slot_bytes
            start = -(-(row_start + first_slot * slot_bytes) // page) * page
            end = (row_start + end_slot * slot_bytes) // page * page
            if end > start and madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                       _MADV_DONTNEED) == 0:
                released += end - start
    return released


def _madvise():
    try:
        return ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
