"""SamplingParams from any dialect's fields; errors name the field as the client spelled it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shoal.api.errors import invalid_parameter
from shoal.engine.sampling import InvalidParameter, SamplingParams


def build_sampling_params(values: Mapping[str, Any],
                          client_names: Mapping[str, str] | None = None) -> SamplingParams:
    """SamplingParams(**values) without the None entries (None means "the default").

    A value SamplingParams rejects becomes APIError(400); client_names maps SamplingParams'
    field names to the dialect's own (max_tokens -> "options.num_predict") for the error.
    """
    try:
        return SamplingParams(**{name: value for name, value in values.items()
                                 if value is not None})
    except InvalidParameter as error:
        client_name = (client_names or {}).get(error.param)
        if client_name is None:
            raise invalid_parameter(error.param, str(error)) from None
        raise invalid_parameter(client_name, f"invalid {client_name}: {error}") from None


def stop_strings(raw: str | list[str] | None) -> tuple[str, ...]:
    """A stop field that may be one string or a list."""
    if raw is None:
        return ()
    return (raw,) if isinstance(raw, str) else tuple(raw)
