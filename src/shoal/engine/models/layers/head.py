"""The output head [vocab, hidden], possibly tied to the embedding.

The plan's backend builds the head (the compiled kernels estimate a big table and rescore
the estimate's top tokens exactly: backends/head_estimates.py); a tied embedding's dense
table is the head's own dense product on any backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from shoal.engine.models.layers.base import Layer
from shoal.engine.models.layers.embedding import Embedding
from shoal.engine.weights.quant import RawTensor

if TYPE_CHECKING:
    from shoal.engine.models.layers.linear import WeightPlan


def build_head(raw: RawTensor, plan: WeightPlan, embedding: Embedding | None,
               spare_bytes: int = 0) -> nn.Module:
    """Output projection [vocab, hidden] giving float32 logits; a tied head multiplies with
    the embedding's own tensor (packed or dense), so the table is held once. spare_bytes:
    memory the model may still take for a copy of the head (its estimate)."""
    if embedding is not None and embedding.weight is not None:
        return ExactHead(plan.backend.dense_linear(embedding.weight), tied=True)
    return plan.backend.head(raw, embedding, spare_bytes)


class ExactHead(Layer):
    """The head's own weights for every row. A tied head's bytes are the embedding's
    (counted once)."""

    def __init__(self, linear: nn.Module, tied: bool) -> None:
        super().__init__()
        self.linear, self.tied = linear, tied
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        # Every row takes the generated-token arithmetic, the last prompt row too: it is one
        # row per request, where a packed prompt path would decode the whole head for it.
        return self.linear(x)

    def nbytes(self) -> int:
        return 0 if self.tied else self.linear.nbytes()
