"""This node's part of one trace: the node process's spans and each of its runners'.

Runners are asked at once (Inspect; answered by their socket reader, so even a runner in a
long step answers quickly), each within a bound; a runner that does not answer is listed,
not waited for. Spans of runners already stopped are gone with them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from shoal.pool.pool import ModelPool

RUNNER_ANSWER_S = 1.0


def runner_label(model: str, instance_id: str, rank: int) -> str:
    return f"{model} rank {rank} ({instance_id})"


async def node_trace(pool: ModelPool, trace_id: str,
                     timeout_s: float = RUNNER_ANSWER_S) -> dict[str, Any]:
    """{"processes": [{"label", "spans", ...}] with spans (the node process first),
    "unanswered": {label: reason}} for trace_id on this node."""
    processes: list[dict[str, Any]] = []
    own = pool.spans.of(trace_id)
    if own:
        processes.append({"label": "node", "spans": own})
    runners = sorted(pool.registry.items(), key=lambda item: item[0])
    answers = await asyncio.gather(*(supervisor.inspect("trace", trace_id, timeout_s)
                                     for _key, supervisor in runners))
    unanswered: dict[str, str] = {}
    for ((instance_id, rank), supervisor), answer in zip(runners, answers):
        label = runner_label(supervisor.model_id, instance_id, rank)
        if answer is None:
            unanswered[label] = (f"no answer within {timeout_s:g} s"
                                 if supervisor.pid is not None else "not running")
        elif answer.get("spans"):
            processes.append({"label": label, "instance_id": instance_id, "rank": rank,
                              "pid": supervisor.pid, "spans": answer["spans"]})
    return {"processes": processes, "unanswered": unanswered}
