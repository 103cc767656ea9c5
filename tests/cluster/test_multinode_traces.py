"""Traces and diagnostics across a pipeline instance split over two real nodes: GET
/v1/traces/{id}, asked of either node, holds the node's queue and server spans and the
prefill and decode steps of both ranks, as valid Chrome trace JSON; GET
/v1/diagnostics/cluster holds both nodes and both ranks' flight recorders (multinode,
slow)."""

from __future__ import annotations

import json

import httpx
import pytest
from test_multinode import cluster_of, start_nodes, stopping, wait_for
from test_multinode_parallel import place

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

TRACE = "5e1f0c3a9b8d7e6f5a4b3c2d1e0f9a8b"
CALLER = "1122334455667788"


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    with stopping(start_nodes(tmp_path_factory.mktemp("traces"), 2)) as nodes:
        wait_for(lambda: all((v := cluster_of(n)) and len(v["nodes"]) == 2 and v["master_id"]
                             for n in nodes), 20, "a two-node cluster")
        yield nodes


def _events_by_thread(trace: dict) -> dict[str, list[dict]]:
    """Thread name ("node", "<model> rank R (<instance>)") -> its complete events."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    threads: dict[str, list[dict]] = {}
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            threads.setdefault(names[(event["pid"], event["tid"])], []).append(event)
    return threads


def test_a_pipeline_request_s_trace_holds_both_ranks_steps(two_nodes):
    first, second = two_nodes
    instance = place(first, "smollm2", "pipeline", 2)
    serving = instance["ranks"][0]["node_id"]
    entry = next(n for n in two_nodes if cluster_of(n)["node_id"] != serving)
    body = {"model": "smollm2", "prompt": "The three primary colours are red, " * 4,
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", entry.url + "/v1/completions", json=body, timeout=300,
                      headers={"traceparent": f"00-{TRACE}-{CALLER}-01"}) as stream:
        assert stream.status_code == 200
        assert stream.headers["traceparent"].split("-")[1] == TRACE
        assert [line for line in stream.iter_lines() if line][-1] == "data: [DONE]"

    for asked in (entry, first if entry is second else second):
        response = httpx.get(f"{asked.url}/v1/traces/{TRACE}", timeout=30)
        assert response.status_code == 200, response.text
        trace = json.loads(response.text)
        for event in trace["traceEvents"]:
            assert {"name", "ph", "pid", "tid", "args"} <= set(event)
            if event["ph"] == "X":
                assert isinstance(event["ts"], int) and event["dur"] >= 0
        threads = _events_by_thread(trace)
        rank0 = next(v for k, v in threads.items() if " rank 0 (" in k)
        rank1 = next(v for k, v in threads.items() if " rank 1 (" in k)
        for rank in (rank0, rank1):
            names = [e["name"] for e in rank]
            assert "prefill" in names and names.count("decode") == 5, names
        assert "wait" in [e["name"] for e in rank0]
        node_spans = {e["name"] for e in threads["node"]}
        assert {"POST /v1/completions", "queue", "remote"} <= node_spans
        processes = {e["args"]["name"] for e in trace["traceEvents"]
                     if e["ph"] == "M" and e["name"] == "process_name"}
        assert len(processes) == 2  # both nodes
        assert "nodes_without_answer" not in trace.get("otherData", {})


def test_cluster_diagnostics_hold_every_node_and_both_ranks_flight_recorders(two_nodes):
    first, second = two_nodes
    if not any(i["sharding"] == "pipeline" and i["status"] == "ready"
               for i in cluster_of(first)["instances"]):
        place(first, "smollm2", "pipeline", 2)
    response = httpx.get(second.url + "/v1/diagnostics/cluster", timeout=60)
    assert response.status_code == 200, response.text
    report = response.json()
    ids = {cluster_of(node)["node_id"] for node in two_nodes}
    assert set(report["nodes"]) == ids and report["unanswered"] == {}
    ranks = {r["rank"]: r for node in report["nodes"].values() for r in node["runners"]}
    assert set(ranks) == {0, 1}
    for runner in ranks.values():
        assert runner["state"] == "ready"
        assert [s["stage"] for s in runner["flight"]["load"]][-1] == "ready"
        assert "group" in [s["stage"] for s in runner["flight"]["load"]]
