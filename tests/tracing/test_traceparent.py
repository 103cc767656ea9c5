"""W3C traceparent: valid headers are read, anything else is ignored (a fresh trace), and
what a response carries is well-formed."""

from __future__ import annotations

import pytest

from shoal.tracing.traceparent import (
    ServerSpan,
    format_traceparent,
    is_trace_id,
    parse_traceparent,
    server_span,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{PARENT}-01"


def test_a_valid_header_is_read():
    parsed = parse_traceparent(VALID)
    assert (parsed.trace_id, parsed.parent_id, parsed.flags) == (TRACE, PARENT, 1)
    assert parse_traceparent(f"  00-{TRACE}-{PARENT}-00 ").flags == 0


def test_a_later_version_may_carry_more_fields():
    assert parse_traceparent(f"01-{TRACE}-{PARENT}-01-whatever").trace_id == TRACE
    assert parse_traceparent(f"01-{TRACE}-{PARENT}-01") is not None


@pytest.mark.parametrize("header", [
    None, "", "garbage", VALID + "-extra",  # version 00 has exactly four fields
    f"ff-{TRACE}-{PARENT}-01",  # version ff is invalid
    f"00-{'0' * 32}-{PARENT}-01", f"00-{TRACE}-{'0' * 16}-01",  # all-zero ids
    f"00-{TRACE.upper()}-{PARENT}-01",  # uppercase hex
    f"00-{TRACE[:-1]}-{PARENT}-01", f"00-{TRACE}-{PARENT}1-01",  # lengths
    f"00_{TRACE}_{PARENT}_01", f"00-{TRACE}-{PARENT}-0g", f"0x-{TRACE}-{PARENT}-01",
    f"01-{TRACE}-{PARENT}-01x",  # a longer later version needs a dash after the flags
])
def test_malformed_headers_are_ignored(header):
    assert parse_traceparent(header) is None


def test_a_server_span_joins_the_caller_s_trace_with_a_new_span_id():
    span = server_span(VALID)
    assert span.trace_id == TRACE and span.parent_id == PARENT
    assert span.span_id != PARENT and len(span.span_id) == 16
    assert span.header == f"00-{TRACE}-{span.span_id}-01"


def test_a_bad_header_starts_a_fresh_trace():
    first, second = server_span("00-nonsense"), server_span(None)
    assert first.parent_id is None and is_trace_id(first.trace_id)
    assert first.trace_id != second.trace_id
    assert parse_traceparent(first.header) is not None


def test_only_the_sampled_flag_is_passed_on():
    assert server_span(f"00-{TRACE}-{PARENT}-03").flags == 1
    assert server_span(f"00-{TRACE}-{PARENT}-00").header.endswith("-00")


def test_formatting():
    assert format_traceparent(TRACE, PARENT) == VALID
    assert ServerSpan(TRACE, PARENT, flags=0).header == f"00-{TRACE}-{PARENT}-00"
    assert not is_trace_id("0" * 32) and not is_trace_id(TRACE[:-1]) and is_trace_id(TRACE)
