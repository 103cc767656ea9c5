"""The W3C `traceparent` header: `VERSION-TRACEID-PARENTID-FLAGS`, e.g.
`00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01`.

A request that carries a valid header joins its trace (the header's trace id, a new span id
for this server's work); a missing or malformed header is not an error: the request starts
a fresh trace. https://www.w3.org/TR/trace-context/#traceparent-header
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

HEADER = "traceparent"
TRACE_ID_PATTERN = r"^[0-9a-f]{32}$"
SPAN_ID_PATTERN = r"^[0-9a-f]{16}$"
SAMPLED = 0x01

_HEX2 = re.compile(r"[0-9a-f]{2}")
_TRACE_ID = re.compile(TRACE_ID_PATTERN)
_SPAN_ID = re.compile(SPAN_ID_PATTERN)
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


@dataclass(frozen=True)
class TraceParent:
    """A parsed header: the caller's trace, the caller's span (our parent), its flags."""

    trace_id: str
    parent_id: str
    flags: int = SAMPLED


@dataclass(frozen=True)
class ServerSpan:
    """This server's span of one request: its trace, its own span id, the caller's span id
    (None when the request started the trace) and the flags passed on."""

    trace_id: str
    span_id: str
    parent_id: str | None = None
    flags: int = SAMPLED

    @property
    def header(self) -> str:
        """The traceparent a response (or a call made on the request's behalf) carries."""
        return format_traceparent(self.trace_id, self.span_id, self.flags)


def new_trace_id() -> str:
    while (trace_id := secrets.token_hex(16)) == _ZERO_TRACE:
        pass
    return trace_id


def new_span_id() -> str:
    while (span_id := secrets.token_hex(8)) == _ZERO_SPAN:
        pass
    return span_id


def is_trace_id(value: str) -> bool:
    """32 lowercase hex digits, not all zero."""
    return bool(_TRACE_ID.match(value)) and value != _ZERO_TRACE


def parse_traceparent(value: str | None) -> TraceParent | None:
    """The header's fields, or None when it is absent or malformed (never raises).

    Version 00 is exactly four fields; a later version may append fields after a dash, which
    are ignored; version ff is invalid. Ids must be lowercase hex and not all zero."""
    if value is None:
        return None
    value = value.strip()
    if len(value) < 55 or (len(value) > 55 and value[55] != "-"):
        return None
    version, trace_id, parent_id, flags = value[:2], value[3:35], value[36:52], value[53:55]
    if value[2] != "-" or value[35] != "-" or value[52] != "-":
        return None
    if not _HEX2.fullmatch(version) or version == "ff" or (version == "00" and len(value) != 55):
        return None
    if not is_trace_id(trace_id) or not _SPAN_ID.match(parent_id) or parent_id == _ZERO_SPAN:
        return None
    if not _HEX2.fullmatch(flags):
        return None
    return TraceParent(trace_id, parent_id, int(flags, 16))


def format_traceparent(trace_id: str, span_id: str, flags: int = SAMPLED) -> str:
    return f"00-{trace_id}-{span_id}-{flags & 0xff:02x}"


def server_span(header: str | None) -> ServerSpan:
    """This server's span for a request carrying header: in the caller's trace when the
    header is valid, else in a fresh one; always a new span id."""
    parent = parse_traceparent(header)
    if parent is None:
        return ServerSpan(new_trace_id(), new_span_id())
    # Only the sampled bit is defined for version 00; other bits are not passed on.
    return ServerSpan(parent.trace_id, new_span_id(), parent.parent_id, parent.flags & SAMPLED)
