"""A real `shoal serve --standalone` with OTEL_EXPORTER_OTLP_ENDPOINT set sends its spans to
an OTLP/HTTP receiver on 127.0.0.1: the node's server span (with the id its traceparent
response header names) and queue wait, and the runner's prefill and decode spans as its
children (slow)."""

from __future__ import annotations

import httpx
import pytest
from otlp_receiver import OtlpReceiver
from serve_process import start_serve

from shoal.tracing.traceparent import parse_traceparent

pytestmark = pytest.mark.slow

TRACE, CALLER = "77" * 16, "88" * 8


def test_a_request_s_spans_are_exported_from_the_node_and_its_runner(tmp_path):
    receiver = OtlpReceiver()
    node = start_serve(["--standalone", "--model", "smollm2", "--threads", "2",
                        "--kv-cache-memory", "128MiB"], tmp_path / "node",
                       env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                            "OTEL_BSP_SCHEDULE_DELAY": "200"})
    try:
        reply = httpx.post(node.url + "/v1/completions", timeout=120, json={
            "model": "smollm2", "prompt": "The sea is", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}, headers={"traceparent": f"00-{TRACE}-{CALLER}-01"})
        assert reply.status_code == 200, reply.text
        server_span = parse_traceparent(reply.headers["traceparent"]).parent_id
        wanted = {"POST /v1/completions", "queue", "generate", "wait", "prefill", "decode"}
        arrived = receiver.wait_for(lambda: wanted <= {s.name for s in receiver.of(TRACE)},
                                    30)
        spans = {s.name: s for s in receiver.of(TRACE)}
        assert arrived, sorted(spans)
    finally:
        node.stop()
        receiver.close()
    server = spans["POST /v1/completions"]
    assert (server.span_id, server.parent_span_id) == (server_span, CALLER)
    for name in ("queue", "generate", "wait", "prefill", "decode"):
        assert spans[name].parent_span_id == server_span, name
    assert spans["decode"].attributes["steps"] == 3  # the first token came from the prefill
    assert spans["prefill"].resource["shoal.role"] == "runner"
    assert server.resource["shoal.role"] == "node"
