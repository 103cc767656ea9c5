"""Model cards: what shoal knows about a model before it loads it (parsed from catalog.toml)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

from shoal.backend_names import BackendName, parse_backend_name
from shoal.engine.models.registry import find_family

ModelKind = Literal["chat", "base", "embedding"]
LocateKind = Literal["package_file", "package_call", "joined_parts"]

_KINDS = ("chat", "base", "embedding")
_FORMATS = ("gguf", "safetensors")
_LOCATE_KINDS = ("package_file", "package_call", "joined_parts")
PART_FIELD = "{part}"  # in a joined_parts module / distribution pattern: the part number


@dataclass(frozen=True)
class Locator:
    """How to find a card's weights inside installed packages (see catalog.toml)."""

    kind: LocateKind
    module: str
    file: str | None = None
    function: str | None = None
    expected_path: str | None = None
    # joined_parts only: module and distribution are patterns with {part} = 1..parts.
    distribution: str | None = None
    parts: int | None = None
    joined_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _LOCATE_KINDS:
            raise ValueError(f"unknown locator kind {self.kind!r}")
        if self.kind == "package_file" and not self.file:
            raise ValueError(f"locator for {self.module}: package_file needs file")
        if self.kind == "package_call" and not self.function:
            raise ValueError(f"locator for {self.module}: package_call needs function")
        if self.kind == "joined_parts":
            self._check_joined_parts()

    def _check_joined_parts(self) -> None:
        where = f"locator for {self.module}: joined_parts"
        if PART_FIELD not in self.module or PART_FIELD not in (self.distribution or ""):
            raise ValueError(f"{where} needs module and distribution patterns with {PART_FIELD}")
        if not self.function:
            raise ValueError(f"{where} needs function (it returns one part's path)")
        if not self.file or "/" in self.file or self.file.startswith("."):
            raise ValueError(f"{where} needs file, a plain name for the joined file")
        if not isinstance(self.parts, int) or self.parts < 1:
            raise ValueError(f"{where} needs parts >= 1")
        if not isinstance(self.joined_size, int) or self.joined_size < 1:
            raise ValueError(f"{where} needs joined_size, the joined file's bytes")

    def part_modules(self) -> tuple[str, ...]:
        """joined_parts: the part modules in joining order (empty for other kinds)."""
        return _numbered(self.module, self.parts or 0)

    def part_distributions(self) -> tuple[str, ...]:
        """joined_parts: the parts' PyPI distributions in joining order (empty otherwise)."""
        return _numbered(self.distribution or "", self.parts or 0)


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
    # What serves it (backend_names.py); None: shoal's engine where it runs the family.
    backend: BackendName | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"model {self.id}: kind must be one of {_KINDS}")
        if self.backend is not None:
            try:
                parse_backend_name(self.backend)
            except ValueError as error:
                raise ValueError(f"model {self.id}: {error}") from None
        if self.backend in (None, "engine"):  # other backends run families shoal does not
            self._check_family()
        if self.format not in _FORMATS:
            raise ValueError(f"model {self.id}: format must be one of {_FORMATS}")
        if self.context_length < 1 or self.size_bytes < 0:
            raise ValueError(f"model {self.id}: context_length and size_bytes must be positive")

    def _check_family(self) -> None:
        # family names a declaration in engine/models/families/, whose task fits the kind.
        family = find_family(self.family)
        if family is None or family.name != self.family:
            raise ValueError(f"model {self.id}: family {self.family!r} is not a model family")
        if (family.task == "embed") != (self.kind == "embedding"):
            raise ValueError(f"model {self.id}: a {self.family} model cannot be {self.kind!r}")

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


def _numbered(pattern: str, count: int) -> tuple[str, ...]:
    return tuple(pattern.replace(PART_FIELD, str(n)) for n in range(1, count + 1))


def _card(entry: dict[str, Any]) -> ModelCard:
    try:
        locate = Locator(**entry["locate"])
        fields = {key: value for key, value in entry.items() if key != "locate"}
        fields["aliases"] = tuple(fields.get("aliases", ()))
        return ModelCard(locate=locate, **fields)
    except (KeyError, TypeError) as error:
        raise ValueError(f"bad catalogue entry {entry.get('id', '?')!r}: {error}") from error
