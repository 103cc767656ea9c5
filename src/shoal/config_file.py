"""Reading shoal's TOML config files (--clients, --tasks) with errors a user can act on.

Every problem, from a syntax error to a typo in a key or a value out of range, is a
ConfigFileError that names the file, the line and the reason: "clients.toml:4: unknown key
'max_concurent' in [tiers.free] (did you mean 'max_concurrent'?)". tomllib keeps no
positions, so semantic errors find their line again in the text (line_of).
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KeyPath = Sequence[str]  # ("tiers", "free", "max_concurrent"); () is the whole file


class ConfigFileError(ValueError):
    """A config file that cannot be used: str is "PATH:LINE: REASON" ("PATH: REASON" when
    no line applies, as for a missing file)."""

    def __init__(self, path: Path, reason: str, line: int | None = None) -> None:
        self.path, self.reason, self.line = Path(path), reason, line
        where = f"{self.path}:{line}" if line is not None else f"{self.path}"
        super().__init__(f"{where}: {reason}")


class FieldError(ValueError):
    """A value a config dataclass rejects, naming the field so that a file loader can point
    at the line that set it. field is a path inside the dataclass: ("max_queued",) or
    ("clients", "alice")."""

    def __init__(self, field: KeyPath, message: str) -> None:
        super().__init__(message)
        self.field = tuple(field)


def is_int(value: object) -> bool:
    # TOML booleans arrive as Python bools, which are ints: `max_queued = true` is a mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def dotted(key_path: KeyPath) -> str:
    return ".".join(key_path)


@dataclass(frozen=True)
class TomlFile:
    """A parsed TOML file that keeps its text, to point errors at lines."""

    path: Path
    text: str
    data: dict[str, Any]

    @classmethod
    def read(cls, path: Path) -> TomlFile:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else error
            raise ConfigFileError(path, f"cannot read the file: {reason}") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            reason, line = _decode_error_position(str(error), text)
            raise ConfigFileError(path, f"invalid TOML: {reason}", line) from None
        return cls(path, text, data)

    def error(self, key_path: KeyPath, reason: str) -> ConfigFileError:
        """The error for the value (or table) at key_path, at the line that sets it."""
        return ConfigFileError(self.path, reason, line_of(self.text, key_path))

    def table(self, key_path: KeyPath, allowed: Collection[str] | None = None
              ) -> dict[str, Any]:
        """The table at key_path ({} when absent); with allowed, a key outside it is an error."""
        value: Any = self.data
        for depth, key in enumerate(key_path, start=1):
            value = value.get(key, {})
            if not isinstance(value, dict):
                raise self.error(key_path[:depth], f"{dotted(key_path[:depth])} must be a "
                                                   f"table, not {value!r}")
        if allowed is not None:
            for key in value:
                if key not in allowed:
                    raise self.error((*key_path, key),
                                     _unknown_key(key, key_path, value[key], allowed))
        return value


def _unknown_key(key: str, key_path: KeyPath, value: Any, allowed: Collection[str]) -> str:
    what = "table" if isinstance(value, dict) else "key"
    where = f" in [{dotted(key_path)}]" if key_path else ""
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.75)  # typos only
    hint = (f" (did you mean {close[0]!r}?)" if close
            else f" (expected one of: {', '.join(sorted(allowed))})" if allowed else "")
    return f"unknown {what} {key!r}{where}{hint}"


_POSITION = re.compile(r"\(at line (\d+), column (\d+)\)$")


def _decode_error_position(message: str, text: str) -> tuple[str, int | None]:
    # Python 3.11's TOMLDecodeError has no lineno attribute; its message ends with
    # "(at line N, column M)", or "(at end of document)", which we report at the last line.
    match = _POSITION.search(message)
    if match is not None:
        return f"{message[:match.start()]}(column {match.group(2)})", int(match.group(1))
    if message.endswith("(at end of document)"):
        return message, max(1, len(text.splitlines()))
    return message, None


# ---- finding a key's line -------------------------------------------------------------------

_KEY = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_DOTTED_KEY = rf"{_KEY}(?:\s*\.\s*{_KEY})*"
_HEADER = re.compile(rf"\s*\[\[?\s*({_DOTTED_KEY})\s*\]\]?\s*(?:#.*)?")
_ASSIGNMENT = re.compile(rf"\s*({_DOTTED_KEY})\s*=")


def _split_key(text: str) -> tuple[str, ...]:
    # Escapes in quoted keys are left as written: good enough to find a line again.
    return tuple(part.strip()[1:-1] if part.strip()[:1] in "\"'" else part.strip()
                 for part in re.findall(rf"{_KEY}", text))


def line_of(text: str, key_path: KeyPath) -> int | None:
    """The 1-based line that sets key_path in TOML text: its `key = ...` or its [table]
    header; else the first line that sets something inside it (a table known only through
    [tiers.free] has no line of its own); else the line that sets its nearest parent (an
    inline table). None when nothing matches."""
    target = tuple(key_path)
    inside: int | None = None
    parent: tuple[int, int] | None = None  # (length of the parent's path, line)
    table: tuple[str, ...] = ()
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER.fullmatch(line)
        if header is not None:
            table = _split_key(header.group(1))
            found = table
        else:
            assignment = _ASSIGNMENT.match(line)
            if assignment is None:
                continue
            found = table + _split_key(assignment.group(1))
        if found == target:
            return number
        if inside is None and found[:len(target)] == target:
            inside = number
        if target[:len(found)] == found and (parent is None or len(found) > parent[0]):
            parent = (len(found), number)
    if inside is not None:
        return inside
    return parent[1] if parent is not None else None
