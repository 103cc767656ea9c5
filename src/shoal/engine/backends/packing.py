"""Weight matrices in the compiled kernels' packed form (kernels/quant_*.cpp).

GGUF types (and dense bf16 / fp16 / fp32 matrices) pack as the file stores them: each
row's product is exact up to float32 sums of bf16 activations and does not depend on how
many rows x has. The kernels also unpack those types into float32 (dense_values), which
any backend may use to dequantize at load.
"""

from __future__ import annotations

import warnings
from types import ModuleType

import numpy as np
import torch

from shoal.engine.models.layers.base import Layer
from shoal.engine.weights.quant import RawTensor

# The kernel's numbering of weight types (quant_formats.h, QType).
QTYPES = {name: code for code, name in enumerate(
    ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
     "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"))}
# Weights per super-block along the input dimension: packed inputs are multiples of it.
_SUPER_K = {name: 256 if name.endswith("_K") or name == "IQ4_XS" else 32 for name in QTYPES}
_DENSE_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def packed_type(raw: RawTensor) -> str | None:
    """The kernel's type for a weight matrix, or None when it cannot stay packed."""
    if len(raw.shape) != 2:
        return None
    name = _DENSE_TYPES.get(raw.data.dtype) if isinstance(raw.data, torch.Tensor) else raw.quant
    if name not in QTYPES or raw.shape[1] % _SUPER_K[name]:
        return None
    return name


def pack(raw: RawTensor, kernel: ModuleType) -> tuple[int, torch.Tensor]:
    """(type code, packed uint8 tensor) of a weight matrix [out, in] (see packed_type)."""
    name = packed_type(raw)
    if name is None:
        raise ValueError(f"{raw.quant} {raw.shape} has no packed form")
    rows, cols = raw.shape
    packed = kernel.quant_pack(QTYPES[name], file_bytes(raw), rows, cols)
    raw.release()  # its file pages: loading holds one tensor's at a time
    return QTYPES[name], packed


def file_bytes(raw: RawTensor) -> torch.Tensor:
    """A weight's bytes as stored (uint8, flat), without a copy where they are contiguous."""
    if isinstance(raw.data, torch.Tensor):
        return raw.data.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    with warnings.catch_warnings():  # the file's read-only bytes are only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(raw.data).reshape(-1).view(np.uint8))


def dense_values(raw: RawTensor, unpacker: ModuleType | None) -> torch.Tensor:
    """float32 values of a weight matrix [out, in]. A GGUF type the kernels pack is unpacked
    by them, which gives gguf's own values exactly (tests/engine/test_quant_kernels.py) and
    loads Qwen2.5-Coder-0.5B in float32 in a fraction of the time gguf's numpy code takes;
    anything else dequantizes in Python (weights/quant.py)."""
    name = packed_type(raw)
    if unpacker is None or name is None or name in _DENSE_TYPES.values():
        return raw.dequantize()
    code, packed = pack(raw, unpacker)
    return unpacker.quant_dequantize(code, packed, *raw.shape)


class QuantLinear(Layer):
    """y = x @ W.T (+ bias) with W packed (kernel QuantLinear); x: [T, in] bf16.

    float_out: float32 results (the output head's logits) instead of bf16. Rows from
    prompt_from on are prompt tokens and the rows before it generated ones: each kind has its
    own arithmetic (on AMX machines prompt rows run on tiles), the same for every batch.
    """

    def __init__(self, op, float_out: bool = False) -> None:
        super().__init__()
        self.op = op
        self.float_out = float_out
        self.out_features = op.out_features

    def forward(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if prompt_from is None or prompt_from >= rows:
            return self.op.forward(x, self.float_out, False)
        if prompt_from <= 0:
            return self.op.forward(x, self.float_out, True)
        return torch.cat((self.op.forward(x[:prompt_from], self.float_out, False),
                          self.op.forward(x[prompt_from:], self.float_out, True)))

    def nbytes(self) -> int:
        return self.op.nbytes()
