"""Durations as clients and config files write them: seconds, or Go's time.ParseDuration syntax.

Ollama's keep_alive accepts both ("300", 300, "5m", "1h30m", "-1s"), so shoal's request
fields and TOML files do too. A number, or a string with no unit, is seconds.
"""

from __future__ import annotations

import math
import re

_SECONDS_PER_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
                     "m": 60.0, "h": 3600.0}
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_UNIT = r"(?:ns|us|µs|μs|ms|s|m|h)"  # both micro signs: Go accepts U+00B5 and U+03BC
# One optional sign for the whole duration, as in Go: "-1h30m" is allowed, "1h-30m" is not.
_DURATION = re.compile(rf"([-+]?)((?:{_NUMBER}{_UNIT})+)")
_PART = re.compile(rf"({_NUMBER})({_UNIT})")


def parse_duration_s(raw: float | int | str) -> float:
    """Seconds in raw: a number of seconds, a string of one ("300", "-1", "2.5"), or a Go
    duration ("5m", "1h30m", "300ms", "-1s", "1.5h"). The sign is kept. ValueError for bools,
    non-finite values and anything else that is not a duration."""
    if isinstance(raw, bool):  # bool is an int subclass: True must not mean one second
        raise ValueError(f"invalid duration {raw!r}: a duration is a number, not a boolean")
    if isinstance(raw, (int, float)):
        seconds = float(raw)
    elif isinstance(raw, str):
        seconds = _parse_text(raw.strip())
    else:
        raise ValueError(f"invalid duration {raw!r}: use a number of seconds or a string "
                         f"such as \"5m\"")
    if not math.isfinite(seconds):
        raise ValueError(f"invalid duration {raw!r}: it must be finite")
    return seconds


def _parse_text(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ValueError(f"invalid duration {text!r}: use seconds (\"300\") or a number with "
                         f"a unit (ns, us, ms, s, m, h) such as \"5m\" or \"1h30m\"")
    total = sum(float(number) * _SECONDS_PER_UNIT[unit]
                for number, unit in _PART.findall(match.group(2)))
    return -total if match.group(1) == "-" else total
