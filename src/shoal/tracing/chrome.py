"""One trace as Chrome trace JSON (chrome://tracing, Perfetto):
{"traceEvents": [{"name", "ph": "X", "ts" (µs), "dur" (µs), "pid", "tid", "args"}, ...]}.

A pid is a node and a tid one process on it (0: the node process, then each runner), named
by "M" (metadata) events, so a split instance shows one row per rank under its node.

Input, per node: {"node_id", "name", "processes": [{"label", "spans": [wire spans],
"error"?}]} where a wire span is spans.Span.to_wire()'s {"name", "ts", "dur", "args"}.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def count_spans(nodes: Sequence[dict[str, Any]]) -> int:
    return sum(len(p.get("spans", ())) for node in nodes for p in node.get("processes", ()))


def chrome_trace(nodes: Sequence[dict[str, Any]],
                 other: dict[str, Any] | None = None) -> dict[str, Any]:
    """The nodes' spans as one Chrome trace; other goes in "otherData" (what was asked,
    which nodes did not answer)."""
    events: list[dict[str, Any]] = []
    for pid, node in enumerate(nodes, start=1):
        label = node.get("name") or node["node_id"]
        events.append(_metadata("process_name", pid, 0, f"{label} ({node['node_id']})"))
        events.append(_metadata("process_sort_index", pid, 0, pid, key="sort_index"))
        for tid, process in enumerate(node.get("processes", ())):
            events.append(_metadata("thread_name", pid, tid, process["label"]))
            events.append(_metadata("thread_sort_index", pid, tid, tid, key="sort_index"))
            for span in process.get("spans", ()):
                events.append({"name": span["name"], "cat": "shoal", "ph": "X",
                               "ts": span["ts"], "dur": span["dur"], "pid": pid, "tid": tid,
                               "args": span.get("args") or {}})
    trace: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if other:
        trace["otherData"] = other
    return trace


def _metadata(name: str, pid: int, tid: int, value: Any, key: str = "name") -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}
