"""Errors the engine raises at its edges; the API maps each to its dialect's status code."""

from __future__ import annotations


class ContextLengthExceeded(ValueError):
    """The prompt (plus the tokens asked for) does not fit the model's context."""


class ModelDoesNotFit(RuntimeError):
    """The model's weights plus a minimal KV cache exceed the memory budget."""


class UnsupportedModel(ValueError):
    """The checkpoint's architecture or a tensor type is not one shoal can run."""
