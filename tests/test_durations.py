"""parse_duration_s: seconds from numbers and Go-style duration strings, ValueError otherwise."""

from __future__ import annotations

import pytest

from shoal.durations import parse_duration_s


@pytest.mark.parametrize("raw,seconds", [
    (0, 0.0), (300, 300.0), (2.5, 2.5), (-1, -1.0), ("300", 300.0), ("-5", -5.0),
    (" 2.5 ", 2.5), ("5m", 300.0), ("1h30m", 5400.0), ("1.5h", 5400.0), ("300ms", 0.3),
    ("-1s", -1.0), ("+2s", 2.0), (".5s", 0.5), ("1h2m3s4ms", 3723.004), ("10us", 1e-5),
    ("10µs", 1e-5), ("10μs", 1e-5), ("7ns", 7e-9), ("-1h30m", -5400.0),
])
def test_durations(raw, seconds):
    assert parse_duration_s(raw) == pytest.approx(seconds)


@pytest.mark.parametrize("raw,reason", [
    (True, "not a boolean"), (False, "not a boolean"), (float("nan"), "finite"),
    (float("inf"), "finite"), ("inf", "finite"), ("", "invalid duration"),
    ("5 minutes", "invalid duration '5 minutes'"), ("m", "unit"), ("5x", "unit"),
    ("1h-30m", "unit"), ("5M", "unit"), ("1h 30m", "unit"), (None, "number of seconds"),
    ([5], "number of seconds"),
])
def test_bad_durations(raw, reason):
    with pytest.raises(ValueError, match="invalid duration") as error:
        parse_duration_s(raw)
    assert reason in str(error.value)
