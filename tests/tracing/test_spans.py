"""Span buffers stay bounded; an engine step is one span shared by its decoding requests;
a trace becomes valid Chrome trace JSON naming nodes and ranks."""

from __future__ import annotations

import json
from dataclasses import dataclass

from shoal.tracing.chrome import chrome_trace, count_spans
from shoal.tracing.spans import SpanBuffer
from shoal.tracing.steps import RequestTrace, StepTracer

A, B = "a" * 32, "b" * 32


@dataclass(frozen=True)
class Chunk:
    request_id: str
    token_ids: tuple[int, ...]
    start_position: int = 0
    prompt: bool = False


class RecordingExporter:
    def __init__(self) -> None:
        self.spans: list[tuple] = []

    def export(self, trace_id, parent_span_id, name, start_ns, end_ns, attributes=None,
               span_id=None) -> None:
        self.spans.append((trace_id, parent_span_id, name, start_ns, end_ns, attributes))


def test_a_full_buffer_drops_its_oldest_spans():
    spans = SpanBuffer(capacity=3)
    for index in range(5):
        spans.record(RequestTrace(A), f"s{index}", index * 1000, index * 1000 + 500)
    assert len(spans) == 3 and spans.recorded == 5
    assert [s["name"] for s in spans.of(A)] == ["s2", "s3", "s4"]
    assert spans.of(A)[0] == {"name": "s2", "ts": 2, "dur": 0.5, "args": {}}
    spans.record(None, "untraced", 0, 1)  # no trace: nothing kept
    assert spans.of(B) == [] and len(spans) == 3


def test_steps_record_wait_prefill_and_one_shared_decode_span():
    tracer = StepTracer(rank=1)
    tracer.begin("r1", RequestTrace(A, "1" * 16), added_ns=1_000)
    tracer.begin("r2", RequestTrace(B, "2" * 16), added_ns=2_000)
    tracer.begin("untraced", None, added_ns=3_000)
    tracer.step([Chunk("r1", (1, 2, 3), prompt=True), Chunk("r2", (4, 5), prompt=True)],
                10_000, 20_000)
    tracer.step([Chunk("r1", (6,)), Chunk("r2", (7,)), Chunk("untraced", (8,))],
                20_000, 30_000)
    a = tracer.spans.of(A)
    assert [s["name"] for s in a] == ["wait", "prefill", "decode"]
    assert a[0]["ts"] == 1 and a[0]["dur"] == 9.0  # added to first scheduled
    assert a[1]["args"] == {"tokens": 3, "position": 0, "step": 1, "batch": 2, "rank": 1}
    assert a[2]["args"] == {"step": 2, "batch": 3, "tokens": 3, "rank": 1}
    assert [s["name"] for s in tracer.spans.of(B)] == ["wait", "prefill", "decode"]
    assert len(tracer.spans) == 5  # the decode step is one span for both traces
    assert tracer.steps == 2


def test_a_mirroring_rank_records_no_wait_and_listens_to_steps():
    tracer, steps = StepTracer(rank=2), []
    tracer.on_step = lambda *step: steps.append(step)
    tracer.begin("r1", RequestTrace(A))
    tracer.step([Chunk("r1", (1,))], 5_000, 6_000)
    assert [s["name"] for s in tracer.spans.of(A)] == ["decode"]
    assert steps == [(5_000, 6_000, 1, 1)]


def test_export_gets_one_decode_span_per_request_when_it_ends():
    tracer = StepTracer()
    tracer.spans.exporter = exporter = RecordingExporter()
    tracer.begin("r1", RequestTrace(A, "1" * 16), added_ns=1_000)
    tracer.step([Chunk("r1", (1, 2), prompt=True)], 2_000, 3_000)
    for start in (3_000, 4_000, 5_000):
        tracer.step([Chunk("r1", (9,))], start, start + 900)
    assert [s[2] for s in exporter.spans] == ["wait", "prefill"]
    tracer.end("r1")
    assert exporter.spans[-1] == (A, "1" * 16, "decode", 3_000, 5_900, {"steps": 3, "rank": 0})
    tracer.end("r1")  # twice is harmless
    assert len(exporter.spans) == 3


def test_chrome_trace_names_nodes_and_ranks():
    span = {"name": "decode", "ts": 10, "dur": 2.5, "args": {"step": 1}}
    parts = [{"node_id": "n1", "name": "alpha",
              "processes": [{"label": "node", "spans": [span]},
                            {"label": "m rank 0 (i1)", "spans": [span, span]}]},
             {"node_id": "n2", "name": "beta",
              "processes": [{"label": "m rank 1 (i1)", "spans": [span]}]}]
    trace = json.loads(json.dumps(chrome_trace(parts, {"trace_id": A})))
    assert count_spans(parts) == 4 and trace["otherData"] == {"trace_id": A}
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in complete} == {(1, 0), (1, 1), (2, 0)}
    assert all(set(e) >= {"name", "ph", "ts", "dur", "pid", "tid", "args"} for e in complete)
    names = {(e["pid"], e["tid"], e["name"]): e["args"] for e in trace["traceEvents"]
             if e["ph"] == "M"}
    assert names[(1, 0, "process_name")] == {"name": "alpha (n1)"}
    assert names[(2, 0, "thread_name")] == {"name": "m rank 1 (i1)"}
