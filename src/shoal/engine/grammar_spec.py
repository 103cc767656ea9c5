"""What a request's output must match, as the engine receives it (no heavy imports, so the
runner and API can build specs without loading torch or the grammar library).

A spec is a JSON schema or a Lark grammar in llguidance's dialect, which may embed JSON
schemas with `%json { ... }`. engine/grammar.py compiles it against the model's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Compact, single-line JSON: a small model given free whitespace can emit newlines forever.
# A schema's own "x-guidance" options still override these.
JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                              "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """Exactly one field is set."""

    json_schema: dict[str, Any] | None = None
    lark: str | None = None

    def __post_init__(self) -> None:
        if (self.json_schema is None) == (self.lark is None):
            raise ValueError("a GrammarSpec needs exactly one of json_schema and lark")


class InvalidGrammar(ValueError):
    """The schema or grammar cannot be compiled (the message says why)."""
