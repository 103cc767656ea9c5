"""Linear layers: dense, int4 weight-only (Q4_0 / Q4_1) and int8 weight-only (per-row scale).

Inputs are always flat token matrices x: [T, in]. The weight-only kernels are fast on CPU only
with bfloat16 activations, so they are used only when the plan keeps weights quantized.
They read the fewest bytes, which is what counts for a few rows (batch-1 decode). For more
rows they turn compute bound (the int4 kernel dequantizes every weight once per 4 rows), so a
quantized layer may also hold a dense bf16 copy for bigger inputs: ~2.5x faster at prefill
sizes; at 16 rows about even in a real step (it reads 4x the bytes of the 4-bit weights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.models.layers.base import Layer
from shoal.engine.parallel.shard import TensorShard
from shoal.engine.weights.quant import RawTensor, can_int4, int4_pack, int8_rows

INT4_GROUP = 32


@dataclass(frozen=True)
class WeightPlan:
    """How to materialise checkpoint tensors.

    keep_quantized: Q4_0/Q4_1 stay 4-bit and Q8_0 becomes per-row int8 (CPU + bfloat16 only);
    otherwise everything is dequantized to compute_dtype.
    """

    compute_dtype: torch.dtype
    device: torch.device
    keep_quantized: bool
    # Quantized layers also keep a dense copy for inputs of more than QUANT_MAX_ROWS rows.
    dense_for_batches: bool = False
    # A tensor-parallel rank: which slice of each layer it holds, and how its partial
    # outputs are summed over the ranks (in place).
    shard: TensorShard | None = None
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None


# Inputs of at most this many rows use a quantized layer's weight-only kernel.
QUANT_MAX_ROWS = 4


class DenseLinear(Layer):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight  # [out, in]
        self.bias = bias
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        return _bytes(self.weight, self.bias)


class PackedLinear(Layer):
    """A dense weight [out, in] reordered once into oneDNN's blocked layout (CPU).

    F.linear reorders the weight on every call; prepacked it is ~25% faster at 16 rows and
    ~2x faster for a wide weight such as a 49k-row output head.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        self.bias = bias
        self.out_features = weight.shape[0]
        self._nbytes = _bytes(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def nbytes(self) -> int:
        return self._nbytes


# oneDNN picks the packed layout for this many rows; other sizes run on it as fast.
PACK_BATCH_HINT = 16
_linear_pointwise = torch.ops.mkldnn._linear_pointwise.default


class Int4Linear(Layer):
    """y = x @ dequant(W).T with W kept as torch's packed int4 (groups of 32 along in)."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                 bias: torch.Tensor | None = None, dense: nn.Module | None = None) -> None:
        super().__init__()
        self.packed = packed
        self.scales_and_zeros = scales_and_zeros  # [in / 32, out, 2]
        self.bias = bias
        self.dense = dense  # the same weight dense, for inputs of more than QUANT_MAX_ROWS
        self.out_features = scales_and_zeros.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] > QUANT_MAX_ROWS:
            return self.dense(x)
        y = _int4_mm(x, self.packed, INT4_GROUP, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        # Without the dense copy: a submodule, counted on its own.
        return _bytes(self.packed, self.scales_and_zeros, self.bias)


# Resolved overloads: calling the packet re-resolves it on every call (~1 us, 120x a step).
_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default
int8_weight_mm = torch.ops.aten._weight_int8pack_mm.default  # (x, q [N, K], scale [N])


class Int8Linear(Layer):
    """y = (x @ q.T) * scale with q int8 [out, in] and one scale per output row.

    torch's weight-only int8 kernel is compute bound past a few rows (49k x 576 head: ~3 ms
    for 1 row, ~15 ms for 16 at 2 threads), so bigger inputs use the dense copy if there is
    one, else an int8 x int8 matmul.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None, dense: nn.Module | None = None) -> None:
        super().__init__()
        self.q = q
        self.scale = scale  # [out]
        self.scale_f32 = scale.float()
        self.bias = bias
        self.dense = dense
        self.out_features = q.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= QUANT_MAX_ROWS or x.device.type != "cpu":
            y = int8_weight_mm(x, self.q, self.scale)
        elif self.dense is not None:
            return self.dense(x)
        else:
            y = self._int8_activations(x)
        return y if self.bias is None else y + self.bias

    def _int8_activations(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, in] quantized to int8 in two levels (per-row scale s, then the remainder at
        s / 127), both levels in one int8 x int8 -> int32 matmul (VNNI): ~3x faster than the
        weight-only kernel at 16 rows, and as accurate as bf16 activations (one level alone
        doubles the logit error: activations have outlier channels)."""
        rows = x.shape[0]
        xf = x.float()
        coarse_scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0  # [M, 1]
        coarse = torch.round(xf / coarse_scale)
        fine_scale = coarse_scale / 127.0
        fine = torch.round((xf - coarse * coarse_scale) / fine_scale).clamp(-127, 127)
        levels = torch.cat((coarse, fine)).to(torch.int8)  # [2M, in]
        acc = torch._int_mm(levels, self.q.t()).float()  # [2M, out] exact int32 sums
        y = torch.addcmul(acc[:rows] * coarse_scale, acc[rows:], fine_scale)
        return (y * self.scale_f32).to(x.dtype)

    def nbytes(self) -> int:
        return _bytes(self.q, self.scale, self.bias)  # the dense copy counts on its own


def build_linear(weights: list[RawTensor], biases: list[RawTensor] | None,
                 plan: WeightPlan) -> nn.Module:
    """One linear layer computing all `weights` at once (outputs concatenated in order).

    Fusing q/k/v or gate/up into one matmul saves kernel launches at batch 1.
    """
    bias = None
    if biases:
        bias = torch.cat([b.dequantize() for b in biases]).to(plan.compute_dtype)
        bias = bias.to(plan.device)
    if plan.keep_quantized and can_int4(weights):
        packed, scales_and_zeros = int4_pack(weights, plan.compute_dtype)
        return Int4Linear(packed, scales_and_zeros, bias, _batch_copy(weights, bias, plan))
    dense = torch.cat([w.dequantize() for w in weights])  # [sum(out), in] float32
    if plan.keep_quantized and all(w.quant == "Q8_0" for w in weights):
        q, scale = int8_rows(dense)
        return Int8Linear(q, scale.to(plan.compute_dtype), bias,
                          _batch_copy(weights, bias, plan, dense))
    return DenseLinear(dense.to(device=plan.device, dtype=plan.compute_dtype), bias)


def _batch_copy(weights: list[RawTensor], bias: torch.Tensor | None, plan: WeightPlan,
                dense: torch.Tensor | None = None) -> PackedLinear | None:
    """The dense copy a quantized layer runs bigger inputs on, if the plan keeps one."""
    if not plan.dense_for_batches:
        return None
    if dense is None:
        dense = torch.cat([w.dequantize() for w in weights])  # [sum(out), in] float32
    return PackedLinear(dense.to(plan.compute_dtype), bias)


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
