"""Reading configuration values: sizes ("512MiB"), and flags over environment variables
(a flag given wins; an empty variable counts as unset), with errors that name the value."""

from __future__ import annotations

import re
from collections.abc import Mapping

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
               "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
               "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(text: str) -> int:
    """Bytes in "512MiB", "2GB", "1.5g" or "123456"; ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}: use a number with an optional unit "
                         f"such as 512MiB, 2GiB or 4GB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def pick(flag, env: Mapping[str, str], name: str):
    if flag is not None:
        return flag
    value = env.get(name)
    return value if value not in (None, "") else None


def as_int(value, what: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be an integer, not {value!r}") from None


def as_float(value, what: str) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, not {value!r}") from None


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def as_bool(value, what: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    raise ValueError(f"{what} must be true or false, not {value!r}")


def as_list(value) -> tuple[str, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else [value]
    return tuple(part.strip() for item in items for part in str(item).split(",")
                 if part.strip())
