"""Errors the engine raises at its edges; the API maps each to its dialect's status code."""

from __future__ import annotations


class ContextLengthExceeded(ValueError):
    """The prompt (plus the tokens asked for) does not fit the model's context."""


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Raise ContextLengthExceeded unless the prompt and the tokens asked for fit."""
    if prompt_tokens >= max_model_len:
        raise ContextLengthExceeded(
            f"the prompt has {prompt_tokens} tokens; this model's context is {max_model_len} "
            f"tokens including at least one generated token")
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthExceeded(
            f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds "
            f"this model's context of {max_model_len} tokens")


class ModelDoesNotFit(RuntimeError):
    """The model's weights plus a minimal KV cache exceed the memory budget."""


class UnsupportedModel(ValueError):
    """The checkpoint's architecture or a tensor type is not one shoal can run."""


class GroupError(RuntimeError):
    """Another rank of a split model is gone, or a wait on it ran out; the instance cannot
    go on."""
