"""The row buffer: a running decode batch's keys and values kept contiguous across steps.

Decoding B requests from the paged cache means gathering every request's whole context, in
every layer, at every step: at 16 requests of ~150 tokens that is ~4 MB copied per layer and
about a quarter of the step. The row buffer is a region of extra slots after the paged blocks
of each layer's cache tensor. While the decode batch stays the same (same requests, in the
same order, each one token longer than at the last step), each step only appends the new
tokens there; rows are rebuilt from the paged blocks, once, when the batch changes or a row
fills. Row b of the batch owns buffer slots first + b * row_len + [0, row_len).

Pure bookkeeping (no torch): the model runner turns a RowLayout into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

# Rows are rebuilt with room to grow by a multiple of this many tokens before the next rebuild.
ROW_GRANULE = 64


@dataclass(frozen=True)
class RowLayout:
    """Where one step's decode batch sits in the row buffer.

    rebuild: rows must be (re)filled from the paged cache (their context up to row_len);
    otherwise each row only appends its newest token, at position context_len - 1.
    """

    first: int
    row_len: int
    rebuild: bool


class RowBuffer:
    def __init__(self, first_slot: int, capacity: int) -> None:
        self.first = first_slot
        self.capacity = capacity
        self._request_ids: tuple[str, ...] = ()
        self._context_lens: tuple[int, ...] = ()
        self._row_len = 0

    def fit(self, request_ids: tuple[str, ...],
            context_lens: tuple[int, ...]) -> RowLayout | None:
        """The batch's row layout this step, or None when it does not fit (it is gathered)."""
        longest = max(context_lens)
        grown = (request_ids == self._request_ids and longest <= self._row_len
                 and all(c == last + 1 for c, last in zip(context_lens, self._context_lens)))
        if grown:
            row_len, rebuild = self._row_len, False
        else:
            row_len = min(-(-(longest + 1) // ROW_GRANULE) * ROW_GRANULE,
                          self.capacity // len(request_ids))
            if row_len < longest:
                self.reset()
                return None
            rebuild = True
        self._request_ids, self._context_lens, self._row_len = request_ids, context_lens, row_len
        return RowLayout(first=self.first, row_len=row_len, rebuild=rebuild)

    def reset(self) -> None:
        """Forget the batch: the next fit rebuilds. Called for every step that does not lay
        out a batch, so a request that finished (and whose id may come back) can never be
        taken for one that merely grew."""
        self._request_ids, self._context_lens, self._row_len = (), (), 0
