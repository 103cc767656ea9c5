"""What one engine step reports per request (plain dataclasses; no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a chosen token and the most likely alternatives at its position."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """New output of one request since the previous step.

    text is the detokenized delta (never broken UTF-8; held back while a stop string may be
    forming). finish_reason is set exactly once, on the request's last output.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Speculative decoding: tokens guessed for this request, and how many of them were kept.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    stop_string: str | None = None  # set on the last output when a stop string ended it
