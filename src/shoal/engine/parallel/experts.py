"""Expert-parallel pieces of a mixture-of-experts layer.

Each rank holds a contiguous range of every mixture-of-experts layer's routed experts and
everything else whole (attention, norms, embedding, head, dense layers, the router, a shared
expert). Every rank routes every row in float32 on the same hidden states, so all make the
same choices; each runs only its own experts on the rows that chose them and the partial
outputs [T, hidden] are summed over the ranks, once per layer, in float32.

Every rank ends with the same bits (RankGroup.all_reduce_: two ranks add in rank order).
One node adds a row's expert outputs one by one in ascending expert order; rank 0 holds the
lower experts, so over two ranks rank 0's partial is a prefix of that sum, and adding rank
1's gives the same bits whenever rank 1 holds at most one of the row's experts or rank 0
none of them: always with top-2 routing, so float32 output is one node's, bit for bit.
Otherwise it differs by float32 rounding of the order only. A shared expert runs on every
rank, like the attention, and is added after the sum, as one node adds it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from shoal.engine.models.layers.base import Layer
from shoal.engine.models.layers.experts import MixtureOfExperts, SharedExpert

AllReduce = Callable[[torch.Tensor], torch.Tensor]

# "layers.3.experts.5.gate.weight": expert 5 of layer 3 (weights/names.py's canonical names).
_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.")


class ExpertParallel(Layer):
    """forward(x [T, hidden], prompt_from) -> [T, hidden] in x's dtype: the sum over the
    ranks of their experts' outputs, plus the shared expert's."""

    def __init__(self, moe: MixtureOfExperts, shared: SharedExpert | None,
                 reduce: AllReduce) -> None:
        super().__init__()
        if moe.shared is not None:
            raise ValueError("the shared expert runs after the sum, not inside a rank's share")
        self.moe = moe
        self.shared = shared
        self._reduce = reduce

    def forward(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        out = self._reduce(self.moe.routed(x, prompt_from).contiguous())  # float32 [T, hidden]
        if self.shared is not None:
            out += self.shared(x, prompt_from)
        return out.to(x.dtype)

    def nbytes(self) -> int:
        return self.moe.nbytes() + (self.shared.nbytes() if self.shared is not None else 0)


def holds_tensor(name: str, experts: tuple[int, int] | None) -> bool:
    """Whether a rank holding `experts` of each layer (None: all) needs this canonical
    tensor: every tensor but other ranks' experts."""
    if experts is None:
        return True
    found = _EXPERT_TENSOR.search(name)
    return found is None or experts[0] <= int(found.group(1)) < experts[1]

