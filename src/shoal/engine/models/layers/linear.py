"""Linear layers: GGUF weights kept packed (QuantLinear), or dense (DenseLinear).

Inputs are always flat token matrices x: [T, in]. On a CPU with bf16 compute every GGUF
type (and dense bf16 / fp16 / fp32 weights) runs packed through the compiled kernel
(kernels/quant_*.cpp): weights stay as the file stores them, each row's result is exact up
to float32 sums of bf16 activations, and it does not depend on how many rows x has. Float32
compute (the reference mode), CUDA, or a machine where the kernel cannot be built use
dequantized dense weights.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from shoal.engine.models.layers.base import Layer
from shoal.engine.parallel.shard import TensorShard
from shoal.engine.weights.quant import RawTensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightPlan:
    """How to materialise checkpoint tensors.

    kernel: the compiled extension when weights stay packed (CPU, bfloat16 compute), else
    None and everything is dequantized to compute_dtype. unpacker: the compiled extension
    wherever it built, for the weights that are dequantized (dense_values).
    """

    compute_dtype: torch.dtype
    device: torch.device
    kernel: ModuleType | None = None
    unpacker: ModuleType | None = None
    # A tensor-parallel rank: which slice of each layer it holds, and how its partial
    # outputs are summed over the ranks (in place).
    shard: TensorShard | None = None
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def keep_quantized(self) -> bool:
        return self.kernel is not None


# The kernel's numbering of weight types (quant_formats.h, QType).
QTYPES = {name: code for code, name in enumerate(
    ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
     "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"))}
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


# Float32 CPU matmuls of some row counts run as W @ x.T: from 2 rows on, F.linear's x @ W.T
# reads W at about a third of the speed one row gets (MKL), where W @ x.T keeps it (4 rows
# of the 896 -> 4864 projection: 1.2 ms against 3.0; of Qwen2.5's 151936-row head: 35 ms
# against 117). Measured on the models' shapes, 2 threads, AVX2: W @ x.T is 1.3-3.2x faster
# at up to 4 rows and 1.0-2.1x at 16, 32, 64 and 128, but up to 1.9x slower at 6-12 or 24.
def _streams_weight(rows: int) -> bool:
    return rows <= 4 or (rows <= 128 and rows % 16 == 0)


class DenseLinear(Layer):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight  # [out, in]
        self.bias = bias
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        w = self.weight
        if w.dtype == torch.float32 and w.device.type == "cpu" and _streams_weight(x.shape[0]):
            y = torch.mm(w, x.t()).t()  # [out, T] -> [T, out]
            return y + self.bias if self.bias is not None else y.contiguous()
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        return _bytes(self.weight, self.bias)


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


def build_linear(weights: list[RawTensor], biases: list[RawTensor] | None,
                 plan: WeightPlan, float_out: bool = False) -> Layer:
    """One linear layer computing all `weights` at once (outputs concatenated in order).

    Fusing q/k/v or gate/up into one matmul saves kernel launches at batch 1; the parts may
    differ in type (a Q4_K_M file mixes them).
    """
    bias = None
    if biases:
        bias = torch.cat([b.dequantize() for b in biases])  # float32 [sum(out)]
    if plan.kernel is not None and all(packed_type(w) for w in weights):
        codes, packed = zip(*(pack(w, plan.kernel) for w in weights))
        op = plan.kernel.QuantLinear(list(codes), list(packed), [w.shape[0] for w in weights],
                                     weights[0].shape[1], bias)
        return QuantLinear(op, float_out)
    if plan.kernel is not None:
        log.info("weights %s %s have no packed form: loaded dequantized",
                 sorted({w.quant for w in weights}), [tuple(w.shape) for w in weights])
    parts = [dense_values(w, plan.unpacker) for w in weights]  # float32 [out, in] each
    dense = parts[0] if len(parts) == 1 else torch.cat(parts)  # [sum(out), in]
    if bias is not None:
        bias = bias.to(device=plan.device, dtype=plan.compute_dtype)
    return DenseLinear(dense.to(device=plan.device, dtype=plan.compute_dtype), bias)


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
