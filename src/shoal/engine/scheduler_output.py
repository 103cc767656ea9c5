"""The contract between the scheduler (pure Python) and the model runner (torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one request whose KV entries this step computes.

    token_ids sit at positions start_position .. start_position + len(token_ids) - 1.
    block_ids is the request's whole block table (KV slot of position p is
    block_ids[p // block_size] * block_size + p % block_size).
    needs_sample is true when the chunk ends at the request's last known token, so the
    model's logits for the chunk's final position choose the next token.
    prompt is true when the chunk starts inside the request's prompt: its tokens take the
    prompt arithmetic (kernels/quant.h), a generated token's step the decode arithmetic,
    whatever else shares the step.
    num_drafts: the chunk's last num_drafts tokens are guesses (speculative decoding) to
    verify: logits come back for each of them and for the token before them, so
    1 + num_drafts rows for this chunk. Their KV entries count only once accepted.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[int, ...]
    needs_sample: bool
    prompt: bool = False
    num_drafts: int = 0

    @property
    def num_logits(self) -> int:
        """Rows of logits this chunk gets back: 0, or 1 plus one per draft."""
        return 1 + self.num_drafts if self.needs_sample else 0

    @property
    def context_len(self) -> int:
        """Tokens attended to by the chunk's last position (cached + new)."""
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work. Chunks are ordered decodes first, then prefills."""

    chunks: tuple[ScheduledChunk, ...]
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
