"""RMSNorm. Gemma's (1 + w) convention is folded into w by the weight readers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.engine.models.layers.base import Layer


class RMSNorm(Layer):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = weight  # [D]
        self.eps = eps
        self.shape = (weight.shape[0],)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., D]. torch's fused rms_norm computes each row alone (float32 sums), so a
        # row's result does not depend on how many rows share the call; in float32 it
        # matches transformers exactly.
        return F.rms_norm(x, self.shape, self.weight, self.eps)
