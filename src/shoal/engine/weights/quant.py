"""Raw checkpoint tensors as the file stores them, and their exact float32 values.

Linear layers keep GGUF tensors packed (models/layers/linear.py, kernels/quant_*); this
module dequantizes where a dense tensor is wanted (float32 compute, biases, norms): Q4_0,
Q4_1 and Q8_0 with vectorised torch code, every other type with gguf.quants.dequantize.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # weights per GGML block for Q4_0 / Q4_1 / Q8_0


@dataclass
class RawTensor:
    """One checkpoint tensor before conversion.

    shape is the torch layout ([out, in] for matrices). quant is "dense" (data is a torch
    tensor) or a GGML type name (data is the uint8 array [rows, bytes per row] as stored).
    """

    shape: tuple[int, ...]
    quant: str
    data: np.ndarray | torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 tensor of self.shape."""
        if self.quant == "dense":
            return self.data.to(torch.float32).reshape(self.shape)
        if self.quant in ("F32", "F16", "BF16"):
            return _plain_gguf(self.data, self.quant).reshape(self.shape)
        if self.quant in _TORCH_DEQUANT:
            # Vectorised torch versions: ~20x faster than gguf's numpy code for big tables.
            return _TORCH_DEQUANT[self.quant](self).reshape(self.shape)
        import gguf  # deferred: only GGUF checkpoints need it

        qtype = gguf.GGMLQuantizationType[self.quant]
        values = gguf.quants.dequantize(np.ascontiguousarray(self.data), qtype)
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(self.shape)

    def release(self) -> None:
        """Drop this tensor's file pages from the process (it has been copied or packed):
        loading then holds the file's pages one tensor at a time, not the whole file. The
        pages stay in the page cache, and reading the tensor again faults them back in."""
        if isinstance(self.data, np.ndarray) and self.data.size and _is_file_mapped(self.data):
            _drop_pages(self.data.ctypes.data, self.data.nbytes)

    def rows(self, order: torch.Tensor) -> RawTensor:
        """The same tensor with its rows (dimension 0) reordered; works on quantized rows."""
        if isinstance(self.data, torch.Tensor):
            return RawTensor(self.shape, self.quant, self.data[order])
        return RawTensor(self.shape, self.quant, self.data[order.numpy()])


_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _is_file_mapped(array: np.ndarray) -> bool:
    """Whether array views a file mapping (a row-reordered copy, say, does not: dropping
    its pages would zero them)."""
    base = array
    while base is not None:
        if isinstance(base, (np.memmap, mmap.mmap)):
            return True
        base = getattr(base, "base", None)
    return False


def _drop_pages(address: int, length: int) -> None:
    """madvise(DONTNEED) over the whole pages inside [address, address + length): for a
    read-only file mapping this only unmaps them from the process."""
    start = -(-address // _PAGE) * _PAGE
    end = (address + length) // _PAGE * _PAGE
    if _libc is not None and end > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


def _plain_gguf(data: np.ndarray, quant: str) -> torch.Tensor:
    array = np.array(data)  # copy: GGUF memmaps are read-only
    if quant == "BF16":
        bits = torch.from_numpy(array.view(np.int16).copy())
        return bits.view(torch.bfloat16).to(torch.float32)
    return torch.from_numpy(array).to(torch.float32)


def _blocks(raw: RawTensor, block_bytes: int) -> np.ndarray:
    """Quantized data as [rows, blocks per row, block bytes] uint8."""
    rows = raw.shape[0]
    return np.ascontiguousarray(raw.data).reshape(rows, -1, block_bytes)


def _fp16(blocks: np.ndarray, offset: int) -> torch.Tensor:
    # [rows, blocks] fp16 scale stored at byte `offset` of each block -> float32
    half = np.ascontiguousarray(blocks[:, :, offset:offset + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(half.astype(np.float32))


def q4_nibbles(raw: RawTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 as (q [N, K] int32 in 0..15, scale [N, K/32], zero [N, K/32]) float32.

    A block holds fp16 d (and fp16 m for Q4_1), then 16 bytes: the low nibble of byte j is
    weight j, the high nibble weight j + 16. Value = d * q + m (Q4_1) or d * (q - 8) (Q4_0).
    """
    has_min = raw.quant == "Q4_1"
    header = 4 if has_min else 2
    blocks = _blocks(raw, header + 16)
    scale = _fp16(blocks, 0)
    packed = torch.from_numpy(np.ascontiguousarray(blocks[:, :, header:]))
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).to(torch.int32)
    q = q.reshape(raw.shape[0], -1)
    zero = _fp16(blocks, 2) if has_min else -8.0 * scale
    return q, scale, zero


def q8_blocks(raw: RawTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 as (q [N, K] int8, block scale [N, K/32] float32); value = d * q."""
    blocks = _blocks(raw, 2 + GROUP)
    scale = _fp16(blocks, 0)
    q = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8))
    return q.reshape(raw.shape[0], -1), scale


def _dequant_q4(raw: RawTensor) -> torch.Tensor:
    q, scale, zero = q4_nibbles(raw)
    rows = q.shape[0]
    grouped = q.view(rows, -1, GROUP).float() * scale[..., None] + zero[..., None]
    return grouped.view(rows, -1)


def _dequant_q8(raw: RawTensor) -> torch.Tensor:
    q, scale = q8_blocks(raw)
    rows = q.shape[0]
    return (q.view(rows, -1, GROUP).float() * scale[..., None]).view(rows, -1)


_TORCH_DEQUANT = {"Q4_0": _dequant_q4, "Q4_1": _dequant_q4, "Q8_0": _dequant_q8}
