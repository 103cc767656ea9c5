"""RMSNorm. Gemma's (1 + w) convention is folded into w by the weight readers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = weight  # [D]
        self.eps = eps
        self.shape = (weight.shape[0],)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., D]; torch's fused kernel accumulates in float32 for bfloat16 inputs.
        return F.rms_norm(x, self.shape, self.weight, self.eps)
