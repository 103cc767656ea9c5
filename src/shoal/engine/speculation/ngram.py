"""Prompt lookup: guess that the text goes on as it did after the last time its tail appeared.

Code edits, quotes, summaries and structured output repeat long runs of their prompt or of
their own earlier output. The index maps every n-gram (n = MIN_N .. MAX_N) of a request's
tokens to where its latest occurrence ended; a guess looks up the longest tail n-gram that
occurred before and proposes the tokens that followed it. Built incrementally: each new
token costs one dict write per n.
"""

from __future__ import annotations

from collections.abc import Sequence

from shoal.engine.speculation.proposer import Proposal

MIN_N = 2
MAX_N = 4


class NgramIndex:
    """One request's tokens (prompt, then output as it is accepted) and its n-gram index."""

    def __init__(self, min_n: int = MIN_N, max_n: int = MAX_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self._sizes = range(max_n, min_n - 1, -1)  # longest match first
        self._tokens: list[int] = []
        # n-gram -> the index just past its latest occurrence, over occurrences ending
        # before the current end (the tail itself is not a match for itself).
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # occurrences ending at positions <= this are in _ends

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, token_ids: Sequence[int]) -> None:
        self._tokens.extend(token_ids)

    def propose(self, count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier occurrence of the longest
        matching tail; [] when no tail n-gram occurred before."""
        tokens = self._tokens
        end = len(tokens)
        self._index_until(end - 1)
        for n in self._sizes:
            if n > end:
                continue
            start = self._ends.get(tuple(tokens[end - n:end]))
            if start is not None:
                return tokens[start:min(start + count, end)]
        return []

    def _index_until(self, last_end: int) -> None:
        """Record occurrences ending at indices up to last_end (exclusive ends)."""
        tokens, ends = self._tokens, self._ends
        for stop in range(self._indexed + 1, last_end + 1):
            for n in self._sizes:
                if n <= stop:
                    ends[tuple(tokens[stop - n:stop])] = stop
        self._indexed = max(self._indexed, last_end)


class NgramProposer:
    """A Proposer over one NgramIndex per request, fed only the tokens it has not seen (a
    context that no longer extends what it saw rebuilds that request's index)."""

    def __init__(self) -> None:
        self._indexes: dict[str, tuple[NgramIndex, list[int]]] = {}

    def propose(self, request_id: str, context: Sequence[int], k: int) -> Proposal:
        entry = self._indexes.get(request_id)
        if entry is None or len(context) < len(entry[1]) \
                or list(context[:len(entry[1])]) != entry[1]:
            entry = self._indexes[request_id] = (NgramIndex(), [])
        index, seen = entry
        fresh = list(context[len(seen):])
        index.extend(fresh)
        seen.extend(fresh)
        tokens = index.propose(k) if k > 0 else []
        return Proposal(tokens=tokens, probs=[1.0] * len(tokens))

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._indexes)
