"""Spans of one engine's steps, for the requests it serves (rank 0, or any rank of a split
instance: each rank records its own steps for the traces in them).

Per step: one "decode" span shared by every request that decoded in it (its trace ids in one
tuple), one "prefill" span per prompt chunk, and, the first time a request is scheduled, a
"wait" span for the time it queued inside the engine. The per-step cost is a few dict
lookups and deque appends (bench/tracing.py measures it).

OTLP carries one trace per span, so a request's decode steps are exported as one "decode"
span (first step's start to last step's end, with the step count) when the request ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from shoal.tracing.spans import Span, SpanBuffer

# (start_ns, end_ns, requests in the step, tokens in the step): the runner's flight recorder
StepListener = Callable[[int, int, int, int], None]


class RequestTrace(NamedTuple):
    """The trace a request belongs to and the span its engine work happens under."""

    trace_id: str
    span_id: str | None = None


class _Traced:
    __slots__ = ("trace", "waiting_since", "decode_start", "decode_end", "decode_steps")

    def __init__(self, trace: RequestTrace, waiting_since: int) -> None:
        self.trace = trace
        self.waiting_since = waiting_since  # 0 once scheduled
        self.decode_start = 0  # for the exported decode span
        self.decode_end = 0
        self.decode_steps = 0


class StepTracer:
    def __init__(self, spans: SpanBuffer | None = None, rank: int = 0) -> None:
        self.spans = spans if spans is not None else SpanBuffer()
        self.rank = rank
        self.on_step: StepListener | None = None
        self.steps = 0
        self._requests: dict[str, _Traced] = {}

    def begin(self, request_id: str, trace: RequestTrace | None,
              added_ns: int | None = None) -> None:
        """request_id belongs to trace from now on (added to the engine at added_ns; a rank
        that only mirrors steps passes None and records no wait)."""
        if trace is not None:
            self._requests[request_id] = _Traced(trace, added_ns or 0)

    def end(self, request_id: str) -> None:
        """The request is finished or aborted: export its decode span, forget it."""
        traced = self._requests.pop(request_id, None)
        exporter = self.spans.exporter
        if traced is not None and exporter is not None and traced.decode_steps:
            exporter.export(traced.trace.trace_id, traced.trace.span_id, "decode",
                            traced.decode_start, traced.decode_end,
                            {"steps": traced.decode_steps, "rank": self.rank})

    def step(self, chunks: Sequence, start_ns: int, end_ns: int) -> None:
        """One step ran chunks (ScheduledChunk: request_id, token_ids, start_position,
        prompt) from start_ns to end_ns."""
        self.steps += 1
        tokens = 0
        decoding: list[str] = []
        exporting = self.spans.exporter is not None
        for chunk in chunks:
            count = len(chunk.token_ids)
            tokens += count
            traced = self._requests.get(chunk.request_id)
            if traced is None:
                continue
            if traced.waiting_since:
                self.spans.record(traced.trace, "wait", traced.waiting_since, start_ns)
                traced.waiting_since = 0
            if chunk.prompt:
                self.spans.record(traced.trace, "prefill", start_ns, end_ns, {
                    "tokens": count, "position": chunk.start_position, "step": self.steps,
                    "batch": len(chunks), "rank": self.rank})
                continue
            decoding.append(traced.trace.trace_id)
            if exporting:
                traced.decode_start = traced.decode_start or start_ns
                traced.decode_end = end_ns
                traced.decode_steps += 1
        if decoding:
            self.spans.add(Span(tuple(decoding), "decode", start_ns, end_ns, {
                "step": self.steps, "batch": len(chunks), "tokens": tokens,
                "rank": self.rank}))
        if self.on_step is not None:
            self.on_step(start_ns, end_ns, len(chunks), tokens)
