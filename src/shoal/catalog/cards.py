"""Model cards: what shoal knows about a model before it loads it (parsed from catalog.toml)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

ModelKind = Literal["chat", "base", "embedding"]
LocateKind = Literal["package_file", "package_call"]

_KINDS = ("chat", "base", "embedding")
_FORMATS = ("gguf", "safetensors")


@dataclass(frozen=True)
class Locator:
    """How to find a card's weights inside an installed package (see catalog.toml)."""

    kind: LocateKind
    module: str
    file: str | None = None
    function: str | None = None
    expected_path: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "package_file" and not self.file:
            raise ValueError(f"locator for {self.module}: package_file needs file")
        if self.kind == "package_call" and not self.function:
            raise ValueError(f"locator for {self.module}: package_call needs function")
        if self.kind not in ("package_file", "package_call"):
            raise ValueError(f"unknown locator kind {self.kind!r}")


@dataclass(frozen=True)
class ModelCard:
    id: str
    aliases: tuple[str, ...]
    description: str
    family: str
    format: Literal["gguf", "safetensors"]
    kind: ModelKind
    quantization: str
    parameters: int
    context_length: int
    size_bytes: int
    package: str
    locate: Locator

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"model {self.id}: kind must be one of {_KINDS}")
        if self.format not in _FORMATS:
            raise ValueError(f"model {self.id}: format must be one of {_FORMATS}")
        if self.context_length < 1 or self.size_bytes < 0:
            raise ValueError(f"model {self.id}: context_length and size_bytes must be positive")

    @property
    def names(self) -> tuple[str, ...]:
        return (self.id, *self.aliases)


def parse_catalog(text: str) -> tuple[ModelCard, ...]:
    """Cards from catalogue TOML; ids and aliases must be unique (case-insensitively)."""
    data = tomllib.loads(text)
    cards = tuple(_card(entry) for entry in data.get("model", []))
    seen: dict[str, str] = {}
    for card in cards:
        for name in card.names:
            key = name.lower()
            if key in seen and seen[key] != card.id:
                raise ValueError(f"catalogue name {name!r} is used by {seen[key]} and {card.id}")
            seen[key] = card.id
    return cards


def load_builtin_catalog() -> tuple[ModelCard, ...]:
    """The catalogue shipped with shoal (src/shoal/catalog/catalog.toml)."""
    text = resources.files("shoal.catalog").joinpath("catalog.toml").read_text(encoding="utf-8")
    return parse_catalog(text)


def _card(entry: dict[str, Any]) -> ModelCard:
    try:
        locate = Locator(**entry["locate"])
        fields = {key: value for key, value in entry.items() if key != "locate"}
        fields["aliases"] = tuple(fields.get("aliases", ()))
        return ModelCard(locate=locate, **fields)
    except (KeyError, TypeError) as error:
        raise ValueError(f"bad catalogue entry {entry.get('id', '?')!r}: {error}") from error
