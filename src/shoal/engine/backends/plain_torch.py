"""TorchBackend: dense weights and torch's own operators, on any device torch runs on.

What float32 compute (the exact reference mode) runs on, and bfloat16 where the compiled
kernels did not build or this CPU lacks the instructions they need.
"""

from __future__ import annotations

from torch import nn

from shoal.engine.backends.base import Backend
from shoal.engine.models.layers.head import ExactHead
from shoal.engine.weights.quant import RawTensor


class TorchBackend(Backend):
    name = "torch"

    def head(self, raw: RawTensor, embedding, spare_bytes: int) -> nn.Module:
        return ExactHead(self.linear([raw], None, float_out=True), tied=False)
