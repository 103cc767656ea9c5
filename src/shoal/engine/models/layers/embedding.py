"""Token embedding (the output head, possibly tied to it, is in head.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.engine.models.layers.base import Layer
from shoal.engine.models.layers.linear import WeightPlan
from shoal.engine.weights.quant import RawTensor


class Embedding(Layer):
    """Row lookup. The table stays packed when the plan's backend keeps it packed (rows are
    dequantized exactly on lookup, and a tied output head multiplies with the same bytes);
    otherwise it is dense. A tied head may split a packed Q8_0 table for its estimate
    (backends/head_estimates.py, SplitTable): rows are then looked up there."""

    def __init__(self, raw: RawTensor, plan: WeightPlan, scale: float | None = None,
                 split_by_head: bool = False) -> None:
        """split_by_head: the table is a tied head's that splits it (the backend's
        splits_table): nothing is held until the head hands its split over (use_split)."""
        super().__init__()
        backend = plan.backend
        self.dtype = plan.compute_dtype
        # (type code, packed, vocab, width, ids [T]) -> float32 [T, width]: exact values
        self.packed_rows = backend.packed_rows
        self.weight: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.split = None  # a SplitTable (head_estimates.py), once a tied head splits it
        self.vocab_size, self.width = raw.shape
        if split_by_head:
            self.type_code = None
        elif backend.packs(raw):
            self.type_code, self.packed = backend.pack(raw)
        else:
            self.weight = backend.dense(raw)
        # Gemma multiplies embeddings by sqrt(hidden) rounded to the compute dtype.
        self.scale = None if scale is None else torch.tensor(scale, dtype=plan.compute_dtype,
                                                             device=plan.device)

    def use_split(self, table) -> None:
        """Look rows up in a tied head's split of this table, which replaces it."""
        self.split, self.packed = table, None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            out = F.embedding(ids, self.weight)  # [T, K]
        elif self.split is not None:
            out = self.split.rows(ids.to(torch.int64)).to(self.dtype)  # [T, K]
        else:
            rows = self.packed_rows(self.type_code, self.packed, self.vocab_size,
                                    self.width, ids)
            out = rows.to(self.dtype)  # [T, K], exact float32 values rounded once
        return out if self.scale is None else out * self.scale

    def nbytes(self) -> int:
        if self.split is not None:
            return self.split.nbytes()
        held = self.weight if self.weight is not None else self.packed
        return 0 if held is None else held.nbytes
