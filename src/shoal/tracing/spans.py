"""Spans kept in memory: one bounded buffer per process (the node, each runner).

A span is recorded once it has ended. Most belong to one request's trace; an engine step
that served a batch is one span naming every trace in it (a decode step costs one record,
not one per request). A full buffer drops its oldest span. Recording is a deque append, so
it is cheap enough for every engine step; finding a trace scans the buffer (rare: a person
asked for it).

Times are wall-clock nanoseconds (time.time_ns), so spans from several processes and
nodes line up (as well as the machines' clocks agree).
"""

from __future__ import annotations

import collections
import time
from typing import Any, Protocol

DEFAULT_CAPACITY = 16384


class TraceRef(Protocol):
    """Which trace a span belongs to, and the span it happens under (None: a root span).
    shoal.protocol.TraceRef and steps.RequestTrace both fit."""

    @property
    def trace_id(self) -> str: ...

    @property
    def span_id(self) -> str | None: ...


class Exporter(Protocol):
    """Where ended spans also go (otlp.OtlpExporter), one trace per span."""

    def export(self, trace_id: str, parent_span_id: str | None, name: str, start_ns: int,
               end_ns: int, attributes: dict[str, Any] | None = None,
               span_id: str | None = None) -> None: ...


class Span:
    """One ended span. trace_ids: every trace it belongs to (a batch step: several)."""

    __slots__ = ("trace_ids", "name", "start_ns", "end_ns", "args")

    def __init__(self, trace_ids: tuple[str, ...], name: str, start_ns: int, end_ns: int,
                 args: dict[str, Any] | None = None) -> None:
        self.trace_ids = trace_ids
        self.name = name
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.args = args

    def to_wire(self) -> dict[str, Any]:
        """{"name", "ts" (µs, wall clock), "dur" (µs), "args"}: msgpack- and JSON-able."""
        return {"name": self.name, "ts": self.start_ns // 1000,
                "dur": round(max(0, self.end_ns - self.start_ns) / 1000, 3),
                "args": dict(self.args or {})}


class SpanBuffer:
    """The last `capacity` spans of one process. Safe to read from another thread while
    one thread records (copying a deque is atomic under the GIL)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("a span buffer holds at least one span")
        self._spans: collections.deque[Span] = collections.deque(maxlen=capacity)
        self.recorded = 0  # spans ever recorded; recorded - len(self) were dropped
        self.exporter: Exporter | None = None

    def __len__(self) -> int:
        return len(self._spans)

    @property
    def capacity(self) -> int:
        return self._spans.maxlen or 0

    def add(self, span: Span) -> None:
        """Keep span (no export: a span shared by several traces is kept here only)."""
        self._spans.append(span)
        self.recorded += 1

    def record(self, trace: TraceRef | None, name: str, start_ns: int,
               end_ns: int | None = None, args: dict[str, Any] | None = None,
               span_id: str | None = None) -> None:
        """One trace's span, ending now unless end_ns says otherwise; also exported when an
        exporter is set (span_id: this span's own id, when others name it as parent).
        No trace: nothing to record."""
        if trace is None:
            return
        end_ns = time.time_ns() if end_ns is None else end_ns
        self.add(Span((trace.trace_id,), name, start_ns, end_ns, args))
        if self.exporter is not None:
            self.exporter.export(trace.trace_id, trace.span_id, name, start_ns, end_ns, args,
                                 span_id)

    def of(self, trace_id: str) -> list[dict[str, Any]]:
        """The spans of trace_id still held, oldest first, in wire form."""
        return [span.to_wire() for span in self._spans.copy() if trace_id in span.trace_ids]
