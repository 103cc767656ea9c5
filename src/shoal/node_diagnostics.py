"""A node's diagnosis (GET /v1/diagnostics/node) and the cluster's (/v1/diagnostics/cluster).

A node's report: who it is, versions, platform and CPU, its configuration with secrets
removed (redact.py), memory (the machine's and each runner's resident memory), each
runner's state and flight recorder, and the node's recent logged errors. Runners are asked
at once, each within a bound; the cluster's report asks every node the same way (a bound
per node) and names those that did not answer, and why.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from shoal.cluster.service import ClusterService
from shoal.config import NodeConfig
from shoal.diagnostics import environment
from shoal.diagnostics.error_log import RecentErrors
from shoal.diagnostics.redact import redact
from shoal.pool.pool import ModelPool
from shoal.pool.traces import runner_label
from shoal.runner.supervisor import RunnerSupervisor

QUERY = "diagnostics"
RUNNER_ANSWER_S = 1.0
NODE_ANSWER_S = 5.0  # longer than a node's own wait on its runners
_ENV_PREFIXES = ("SHOAL_", "OTEL_")


class NodeDiagnostics:
    def __init__(self, config: NodeConfig, pool: ModelPool, cluster: ClusterService,
                 errors: RecentErrors) -> None:
        self.config = config
        self.pool = pool
        self.cluster = cluster
        self.errors = errors
        self.started_at = time.time()
        cluster.queries.serve(QUERY, lambda _args: self.node_report())

    def secrets(self) -> tuple[str, ...]:
        """Values that must never show, wherever they would appear."""
        env_keys = os.environ.get("SHOAL_API_KEY", "")
        return (*self.config.server.api_keys, self.config.cluster.secret,
                *(k.strip() for k in env_keys.split(",")))

    async def node_report(self) -> dict[str, Any]:
        runners = sorted(self.pool.registry.items(), key=lambda item: item[0])
        flights = await asyncio.gather(*(s.inspect("flight", timeout_s=RUNNER_ANSWER_S)
                                         for _key, s in runners))
        memory = {**environment.node_memory(), "runners": [
            {"runner": runner_label(s.model_id, instance_id, rank), "pid": s.pid,
             **(s.memory.model_dump(exclude={"type"}) if s.memory is not None else {})}
            for (instance_id, rank), s in runners]}
        report = {
            "node": self._identity(),
            "versions": environment.versions(),
            "platform": environment.platform_summary(),
            "cpu": environment.cpu_summary(),
            "configuration": {"settings": self.config, "environment": {
                name: value for name, value in sorted(os.environ.items())
                if name.startswith(_ENV_PREFIXES)}},
            "memory": memory,
            "runners": [_runner(instance_id, rank, s, flight)
                        for ((instance_id, rank), s), flight in zip(runners, flights)],
            "recent_errors": self.errors.recent(),
            "spans": {"held": len(self.pool.spans), "capacity": self.pool.spans.capacity,
                      "recorded": self.pool.spans.recorded},
        }
        return redact(report, self.secrets())

    def _identity(self) -> dict[str, Any]:
        cluster = self.cluster
        info = cluster.state.nodes.get(cluster.node_id)
        return {"node_id": cluster.node_id, "name": info.name if info else None,
                "master_id": cluster.master_id, "standalone": self.config.cluster.standalone,
                "pid": os.getpid(), "time": time.time(),
                "uptime_s": round(time.time() - self.started_at, 3)}

    async def cluster_report(self, timeout_s: float = NODE_ANSWER_S) -> dict[str, Any]:
        """{"nodes": {node id: its report}, "unanswered": {node id: why}}: every node of
        the state, this one included; those not connected or silent are named."""
        cluster = self.cluster
        own = asyncio.ensure_future(self.node_report())
        answers = await cluster.queries.ask(QUERY, {}, timeout_s)
        nodes = {cluster.node_id: await own}
        unanswered: dict[str, str] = {}
        for node_id, answer in sorted(answers.items()):
            if answer.error is None and isinstance(answer.body, dict):
                nodes[node_id] = answer.body
            else:
                unanswered[node_id] = answer.error or "malformed answer"
        for node_id in cluster.state.nodes:
            if node_id not in nodes and node_id not in unanswered:
                unanswered[node_id] = "not connected to this node"
        return {"asked_by": cluster.node_id, "time": time.time(), "nodes": nodes,
                "unanswered": unanswered}


def _runner(instance_id: str, rank: int, supervisor: RunnerSupervisor,
            flight: dict[str, Any] | None) -> dict[str, Any]:
    described = {"instance_id": instance_id, "rank": rank, "model": supervisor.model_id,
                 "state": supervisor.state, "pid": supervisor.pid,
                 "restarts": supervisor.restarts, "last_error": supervisor.last_error,
                 "in_flight": supervisor.num_in_flight, "flight": flight}
    if flight is None:
        described["flight_error"] = (f"no answer within {RUNNER_ANSWER_S:g} s"
                                     if supervisor.pid is not None else "not running")
    return described
