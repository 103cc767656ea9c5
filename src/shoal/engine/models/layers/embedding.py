"""Token embedding (the output head, possibly tied to it, is in head.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.engine.models.layers.base import Layer
from shoal.engine.models.layers.linear import WeightPlan
from shoal.engine.weights.quant import RawTensor, q8_blocks


class Embedding(Layer):
    """Row lookup. A Q8_0 table stays int8 with its per-32 block scales when the plan keeps
    weights quantized (rows are dequantized exactly on lookup); otherwise it is dense."""

    def __init__(self, raw: RawTensor, plan: WeightPlan, scale: float | None = None) -> None:
        super().__init__()
        self.dtype = plan.compute_dtype
        self.weight: torch.Tensor | None = None
        if plan.keep_quantized and raw.quant == "Q8_0":
            self.q8, self.q8_scale = q8_blocks(raw)  # [V, K] int8, [V, K / 32] float32
        else:
            self.q8 = self.q8_scale = None
            self.weight = raw.dequantize().to(device=plan.device, dtype=plan.compute_dtype)
        # Gemma multiplies embeddings by sqrt(hidden) rounded to the compute dtype.
        self.scale = None if scale is None else torch.tensor(scale, dtype=plan.compute_dtype,
                                                             device=plan.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            out = F.embedding(ids, self.weight)  # [T, K]
        else:
            rows = self.q8[ids].view(ids.shape[0], -1, 32).float()  # [T, K / 32, 32]
            out = (rows * self.q8_scale[ids].unsqueeze(-1)).flatten(1).to(self.dtype)
        return out if self.scale is None else out * self.scale

    def nbytes(self) -> int:
        tensors = (self.weight,) if self.weight is not None else (self.q8, self.q8_scale)
        return sum(t.numel() * t.element_size() for t in tensors)

