"""Linear layers' plan and their dense form (DenseLinear).

Inputs are always flat token matrices x: [T, in]. The plan's backend builds each linear
layer: the compiled CPU kernels keep GGUF weights packed (backends/packing.py,
QuantLinear); dense weights in the compute dtype (DenseLinear) serve float32 compute (the
reference mode), other devices, and a machine where the kernels cannot be built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.models.layers.base import Layer
from shoal.engine.parallel.shard import TensorShard
from shoal.engine.weights.quant import RawTensor

if TYPE_CHECKING:
    from shoal.engine.backends.base import Backend


@dataclass(frozen=True)
class WeightPlan:
    """How to materialise checkpoint tensors: the backend that builds every layer, and the
    part of each layer this rank holds."""

    backend: Backend
    # A tensor-parallel rank: which slice of each layer it holds, and how its partial
    # outputs are summed over the ranks (in place).
    shard: TensorShard | None = None
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    # An expert-parallel rank: the half-open range of each mixture-of-experts layer's
    # experts it holds; the layer's partial output is summed over the ranks with reduce.
    experts: tuple[int, int] | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.backend.compute_dtype

    @property
    def device(self) -> torch.device:
        return self.backend.device


# Float32 CPU matmuls of some row counts run as W @ x.T: from 2 rows on, F.linear's x @ W.T
# reads W at about a third of the speed one row gets (MKL), where W @ x.T keeps it (4 rows
# of the 896 -> 4864 projection: 1.2 ms against 3.0; of Qwen2.5's 151936-row head: 35 ms
# against 117). Measured on the models' shapes, 2 threads, AMD AVX2: W @ x.T is 1.3-3.2x
# faster at up to 4 rows and 1.0-2.1x at 16, 32, 64 and 128, but up to 1.9x slower at 6-12
# or 24. On Intel CPUs x @ W.T is the fast one: the backend streams weights on AMD only.
def _streams_weight(rows: int) -> bool:
    return rows <= 4 or (rows <= 128 and rows % 16 == 0)


class DenseLinear(Layer):
    """streams_weight: float32 weights on CPU, which some row counts multiply as W @ x.T
    (the backend says so at load)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 streams_weight: bool = False) -> None:
        super().__init__()
        self.weight = weight  # [out, in]
        self.bias = bias
        self.out_features = weight.shape[0]
        self.streams_weight = streams_weight

    def forward(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        if self.streams_weight and _streams_weight(x.shape[0]):
            y = torch.mm(self.weight, x.t()).t()  # [out, T] -> [T, out]
            return y + self.bias if self.bias is not None else y.contiguous()
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        return _bytes(self.weight, self.bias)


def build_linear(weights: list[RawTensor], biases: list[RawTensor] | None,
                 plan: WeightPlan, float_out: bool = False) -> nn.Module:
    """One linear layer computing all `weights` at once (outputs concatenated in order).

    Fusing q/k/v or gate/up into one matmul saves kernel launches at batch 1; the parts may
    differ in type (a Q4_K_M file mixes them).
    """
    return plan.backend.linear(weights, biases, float_out)


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
