"""Per-request sampling parameters, validated once at the edge of the engine.

The batched `Sampler` that applies them lives in `sampler.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class InvalidParameter(ValueError):
    """A user-settable parameter is out of range; `param` names it for the API's error body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request.

    temperature 0 means greedy. top_k 0 and top_p 1.0 and min_p 0.0 disable those filters.
    max_tokens None means "until the context is full".
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    # Speculative decoding for this request (x_speculative): "off", "ngram", "draft", or
    # None for the model's own setting. It changes speed only, never the distribution.
    speculative: str | None = None
    # False: the output text keeps special tokens (a chat format parsed after the engine,
    # harmony's <|channel|> headers); the end token itself is never shown.
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check(math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0,
               "temperature", "temperature must be between 0 and 100")
        _check(0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", "top_k must be >= 0 (0 disables it)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]")
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty",
               "repetition_penalty must be in (0, 10]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               "presence_penalty must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               "frequency_penalty must be in [-2, 2]")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               "max_tokens must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", "min_tokens must be >= 0")
        _check(len(self.stop) <= 16 and all(isinstance(s, str) and s for s in self.stop),
               "stop", "stop must be at most 16 non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "stop_token_ids must be non-negative integers")
        _check(all(isinstance(k, int) and k >= 0 and -100.0 <= v <= 100.0
                   for k, v in self.logit_bias.items()),
               "logit_bias", "logit_bias maps token ids to values in [-100, 100]")
        _check(0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
               f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed",
               "seed must be a non-negative 63-bit integer")
        _check(self.speculative in (None, "off", "ngram", "draft"), "x_speculative",
               "x_speculative must be \"off\", \"ngram\" or \"draft\"")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Reject token ids the model does not have; called once the model is known."""
        bad = [t for t in (*self.logit_bias, *self.stop_token_ids) if t >= vocab_size]
        if bad:
            param = "logit_bias" if bad[0] in self.logit_bias else "stop_token_ids"
            raise InvalidParameter(param, f"token id {bad[0]} is outside the vocabulary "
                                          f"(size {vocab_size})")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(param, message)
