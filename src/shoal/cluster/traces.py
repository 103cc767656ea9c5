"""One trace gathered from the whole cluster: this node's part and every other node's,
asked over the cluster (queries.py) with a bound per node.

A node's part is {"node_id", "name", "processes": [...], "unanswered": {...}} (see
pool/traces.py); tracing/chrome.py turns the parts into Chrome trace JSON.
"""

from __future__ import annotations

from typing import Any

from shoal.cluster.queries import ClusterQueries
from shoal.cluster.state import ClusterState
from shoal.ids import NodeId
from shoal.pool.pool import ModelPool
from shoal.pool.traces import node_trace

QUERY = "trace"
NODE_ANSWER_S = 3.0  # longer than a node's own wait on its runners


def node_name(state: ClusterState, node_id: NodeId) -> str:
    info = state.nodes.get(node_id)
    return info.name if info is not None else node_id


async def own_part(pool: ModelPool, state: ClusterState, node_id: NodeId,
                   trace_id: str) -> dict[str, Any]:
    return {"node_id": node_id, "name": node_name(state, node_id),
            **await node_trace(pool, trace_id)}


async def cluster_trace(queries: ClusterQueries, pool: ModelPool, state: ClusterState,
                        node_id: NodeId, trace_id: str, timeout_s: float = NODE_ANSWER_S
                        ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """(every node's part that holds spans of trace_id, {node id: why it gave no answer})."""
    parts = [await own_part(pool, state, node_id, trace_id)]
    missing: dict[str, str] = {}
    answers = await queries.ask(QUERY, {"trace_id": trace_id}, timeout_s)
    for other, answer in sorted(answers.items()):
        if answer.error is not None or not isinstance(answer.body, dict):
            missing[other] = answer.error or "malformed answer"
        else:
            parts.append(answer.body)
    return [p for p in parts if p.get("processes") or p.get("unanswered")], missing
