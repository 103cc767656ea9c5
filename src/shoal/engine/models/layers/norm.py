"""RMSNorm. Gemma's (1 + w) convention is folded into w by the weight readers."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from shoal.engine.models.layers.base import Layer


class RMSNorm(Layer):
    """norm_rows(x, weight, eps): the backend's norm of bf16 rows [T, D] in one pass (the
    compiled kernels' rms_norm_rows: the decode kernel's arithmetic, float32 sums rounded
    once), for a bf16 weight; None, or any other input, takes torch's rms_norm."""

    def __init__(self, weight: torch.Tensor, eps: float,
                 norm_rows: Callable | None = None) -> None:
        super().__init__()
        self.weight = weight  # [D]
        self.eps = eps
        self.shape = (weight.shape[0],)
        self.norm_rows = norm_rows if weight.dtype == torch.bfloat16 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., D]. Both forms compute each row alone (float32 sums), so a row's result
        # does not depend on how many rows share the call; torch's in float32 matches
        # transformers exactly.
        if (self.norm_rows is not None and x.dtype == torch.bfloat16 and x.dim() == 2
                and x.is_contiguous()):
            return self.norm_rows(x, self.weight, self.eps)
        return F.rms_norm(x, self.shape, self.weight, self.eps)
