"""The output head [vocab, hidden], possibly tied to the embedding."""

from __future__ import annotations

from torch import nn

from shoal.engine.models.layers.embedding import Embedding
from shoal.engine.models.layers.linear import DenseLinear, QuantLinear, WeightPlan, build_linear
from shoal.engine.weights.quant import RawTensor


def build_head(raw: RawTensor, plan: WeightPlan, embedding: Embedding | None) -> nn.Module:
    """Output projection [vocab, hidden] giving float32 logits; a tied head multiplies with
    the embedding's own tensor (packed or dense), so the table is held once."""
    if embedding is not None and embedding.packed is not None:
        op = plan.kernel.QuantLinear([embedding.type_code], [embedding.packed],
                                     [embedding.vocab_size], embedding.width, None)
        return TiedHead(QuantLinear(op, float_out=True))
    if embedding is not None and embedding.weight is not None:
        return TiedHead(DenseLinear(embedding.weight))
    return build_linear([raw], None, plan, float_out=True)


class TiedHead(nn.Module):
    """A head sharing the embedding's tensor: its bytes are the embedding's (counted once)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear
        self.out_features = linear.out_features

    def forward(self, x, prompt_from: int | None = None):
        return self.linear(x, prompt_from)

    def nbytes(self) -> int:
        return 0
