"""The output head [vocab, hidden], possibly tied to the embedding.

A Q8_0 head kept quantized is the biggest single read of a batch-1 decode step (SmolLM2:
49,152 x 576 int8, 28 MB, ~2 ms at this CPU's memory bandwidth). RescoredHead reads a 4-bit
copy instead (half the bytes) to find each row's candidate tokens, then recomputes those
candidates' logits from the int8 rows: the tokens that sampling can realistically pick get
the int8 head's values, the far tail keeps the 4-bit estimate.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.models.layers.base import Layer
from shoal.engine.models.layers.embedding import Embedding
from shoal.engine.models.layers.linear import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    WeightPlan,
    build_linear,
    int8_weight_mm,
)
from shoal.engine.weights.quant import RawTensor, int4_from_dense

# Candidates rescored per row. The 4-bit head's top-1 disagrees with the int8 head's on ~4%
# of SmolLM2 rows, but the int8 winner was inside the 4-bit top 64 on every row measured, so
# the rescored argmax equals the int8 argmax.
RESCORE_CANDIDATES = 64
# Past a few rows the int4 kernel turns compute bound and the plain int8 head is as fast.
RESCORE_MAX_ROWS = 4


class RescoredHead(Layer):
    """logits = int8 head on the top RESCORE_CANDIDATES tokens of a 4-bit estimate."""

    def __init__(self, exact: Int8Linear, estimate: Int4Linear) -> None:
        super().__init__()
        self.exact, self.estimate = exact, estimate
        self.out_features = exact.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [S, hidden] -> float32 logits [S, vocab]."""
        rows = x.shape[0]
        if rows > RESCORE_MAX_ROWS:
            return self.exact(x).float()
        logits = self.estimate(x).float()                          # [S, V]
        # Every row's candidates, rescored for all rows at once: [S * C] token ids.
        candidates = logits.topk(RESCORE_CANDIDATES, dim=-1).indices.flatten()
        exact = int8_weight_mm(x, self.exact.q[candidates], self.exact.scale[candidates])
        return logits.scatter_(1, candidates.expand(rows, -1), exact.float())


def build_head(raw: RawTensor, plan: WeightPlan, embedding: Embedding | None) -> nn.Module:
    """Output projection [vocab, hidden]; a dense tied head shares the embedding's tensor."""
    if embedding is not None and embedding.weight is not None:
        return DenseLinear(embedding.weight)
    head = build_linear([raw], None, plan)
    if isinstance(head, Int8Linear) and plan.device.type == "cpu" and raw.shape[1] % 64 == 0:
        packed, scales_and_zeros = int4_from_dense(raw.dequantize(), plan.compute_dtype)
        return RescoredHead(head, Int4Linear(packed, scales_and_zeros))
    return head
