"""Reasoning fields every dialect needs: an effort checked once, the request it makes."""

from __future__ import annotations

from typing import Any

from shoal.api.errors import invalid_parameter
from shoal.protocol import ReasoningRequest

EFFORTS = ("low", "medium", "high")


def effort_request(value: Any, param: str) -> ReasoningRequest | None:
    """The reasoning asked for by an effort field (None: not given); APIError(400) for an
    effort that is not "low", "medium" or "high"."""
    if value is None:
        return None
    if value not in EFFORTS:
        raise invalid_parameter(param, f'{param} must be "low", "medium" or "high", not '
                                       f"{value!r}")
    return ReasoningRequest(effort=value, param=param)
