"""Trace context over HTTP: a traceparent header is honoured (or a fresh trace begins), every
response carries one (streams too), and GET /v1/traces/{id} returns the request's spans as
Chrome trace JSON (404 / 400 in OpenAI's error shape otherwise; API keys apply)."""

from __future__ import annotations

import httpx
from fakes import ScriptedRouter
from fastapi.testclient import TestClient

from shoal.api.app import create_app
from shoal.api.auth import ApiKeys
from shoal.tracing.traceparent import parse_traceparent

TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER = "b7ad6b7169203331"
HI = [{"role": "user", "content": "hi"}]


def _traceparent(response) -> tuple[str, str]:
    parsed = parse_traceparent(response.headers["traceparent"])
    assert parsed is not None, response.headers["traceparent"]
    return parsed.trace_id, parsed.parent_id


def test_a_request_joins_the_caller_s_trace_and_its_spans_can_be_fetched(fake_node):
    header = {"traceparent": f"00-{TRACE}-{CALLER}-01"}
    body = {"model": "fake-model", "messages": HI, "max_tokens": 4}
    reply = httpx.post(fake_node.url + "/v1/chat/completions", json=body, headers=header,
                       timeout=30)
    assert reply.status_code == 200, reply.text
    trace_id, span_id = _traceparent(reply)
    assert trace_id == TRACE and span_id != CALLER

    trace = httpx.get(f"{fake_node.url}/v1/traces/{TRACE}", timeout=30)
    assert trace.status_code == 200, trace.text
    events = trace.json()["traceEvents"]
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert {"POST /v1/chat/completions", "queue", "generate"} <= set(spans)
    server = spans["POST /v1/chat/completions"]
    assert server["args"]["request_id"] == reply.headers["x-request-id"]
    assert server["args"]["status"] == 200 and server["dur"] > 0
    assert all(server["ts"] <= spans[n]["ts"] for n in ("queue", "generate"))
    names = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
    assert names == ["node"]


def test_streams_carry_traceparent_and_a_bad_header_starts_a_fresh_trace(fake_node):
    body = {"model": "fake-model", "messages": HI, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", fake_node.url + "/v1/chat/completions", json=body,
                      headers={"traceparent": "00-not-a-trace-01"}, timeout=30) as stream:
        assert stream.status_code == 200
        trace_id, _ = _traceparent(stream)
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and trace_id != TRACE
    trace = httpx.get(f"{fake_node.url}/v1/traces/{trace_id}", timeout=30).json()
    assert "generate" in {e["name"] for e in trace["traceEvents"]}


def test_unknown_and_malformed_trace_ids(fake_node):
    unknown = httpx.get(f"{fake_node.url}/v1/traces/{'1' * 32}", timeout=30)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "trace_not_found"
    assert unknown.json()["error"]["param"] == "trace_id"
    malformed = httpx.get(f"{fake_node.url}/v1/traces/xyz", timeout=30)
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] == "trace_id"
    assert "traceparent" in malformed.headers  # every response carries one


def test_traces_want_an_api_key_like_every_route():
    client = TestClient(create_app(ScriptedRouter(), list_available=list,
                                   api_keys=ApiKeys(["sk-test"])))
    reply = client.post("/v1/chat/completions", json={"model": "m", "messages": HI},
                        headers={"Authorization": "Bearer sk-test"})
    trace_id, _ = _traceparent(reply)
    assert client.get(f"/v1/traces/{trace_id}").status_code == 401
    ok = client.get(f"/v1/traces/{trace_id}", headers={"Authorization": "Bearer sk-test"})
    assert ok.status_code == 200
    assert {e["name"] for e in ok.json()["traceEvents"]} >= {"POST /v1/chat/completions"}
    assert "traceparent" in client.get("/health").headers
