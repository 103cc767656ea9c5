"""OTLP export: nothing without an endpoint; with one, finished spans reach an OTLP/HTTP
receiver with shoal's own ids, parents and attributes."""

from __future__ import annotations

import pytest
from otlp_receiver import OtlpReceiver

from shoal.tracing.otlp import OtlpExporter
from shoal.tracing.spans import SpanBuffer
from shoal.tracing.steps import RequestTrace

TRACE, SERVER, CALLER = "ab" * 16, "12" * 8, "34" * 8


@pytest.fixture
def receiver():
    server = OtlpReceiver()
    yield server
    server.close()


def test_nothing_is_exported_without_an_endpoint(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert OtlpExporter.from_env({}) is None


def test_recorded_spans_reach_the_receiver(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    exporter = OtlpExporter.from_env({"shoal.role": "node", "shoal.node_id": "n1"})
    spans = SpanBuffer()
    spans.exporter = exporter
    spans.record(RequestTrace(TRACE, CALLER), "POST /v1/completions", 1_000, 9_000,
                 {"status": 200, "model": None}, span_id=SERVER)
    spans.record(RequestTrace(TRACE, SERVER), "queue", 2_000, 3_000, {"for_peer": True,
                                                                       "odd": (1, 2)})
    exporter.shutdown()  # flushes
    got = {s.name: s for s in receiver.of(TRACE)}
    server, queue = got["POST /v1/completions"], got["queue"]
    assert (server.span_id, server.parent_span_id) == (SERVER, CALLER)
    assert queue.parent_span_id == SERVER and queue.span_id not in (SERVER, CALLER)
    assert (queue.start_ns, queue.end_ns) == (2_000, 3_000)
    assert server.attributes == {"status": 200}  # None left out
    assert queue.attributes == {"for_peer": True, "odd": "(1, 2)"}
    assert server.resource["service.name"] == "shoal"
    assert server.resource["shoal.node_id"] == "n1"
