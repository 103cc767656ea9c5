"""ClusterState: the one event-sourced view every node agrees on.

Changed only by shoal.cluster.apply.apply. Readings that are last-writer-wins (memory, load,
backends, liveness) are not here: they ride the telemetry plane and are never event-sourced.
Mappings are rebuilt, never mutated, by apply; treat them as read-only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shoal.cluster.instances import Frozen, Instance
from shoal.ids import InstanceId, NodeId, RequestId, RunnerId
from shoal.protocol import GenerationRequest

# starting: process spawning; idle: up, nothing loaded; loading; ready: serving;
# failed: gave up (crash loop, load error); stopped: torn down (apply removes the entry).
RunnerPhase = Literal["starting", "idle", "loading", "ready", "failed", "stopped"]
# active: submitted, being served or waiting; cancelled: the client went away, the serving
# node must abort it. Finished and failed tasks leave the state.
TaskStatus = Literal["active", "cancelled"]
InstanceStatus = Literal["starting", "loading", "ready", "failed"]


class NodeInfo(Frozen):
    """A cluster member as the master admitted it. addresses: its API endpoints (host:port)."""

    node_id: NodeId
    name: str
    addresses: tuple[str, ...] = ()


class RunnerStatus(Frozen):
    runner_id: RunnerId
    instance_id: InstanceId
    node_id: NodeId
    phase: RunnerPhase
    message: str = ""  # why it failed, or a loading stage
    # What the rank holds, measured once loaded (resident memory plus KV blocks reserved
    # but not yet touched): what it counts against its node's memory budget.
    memory_bytes: int | None = None
    # What it holds on the node's accelerators (GPU memory), beside memory_bytes.
    device_bytes: int | None = None


class Task(Frozen):
    """One generation request bound to an instance; rank 0's node serves it.

    owner_node is the node whose API holds the client's stream (chunks go to data/<owner>).
    """

    task_id: RequestId
    instance_id: InstanceId
    owner_node: NodeId
    request: GenerationRequest
    status: TaskStatus = "active"

    @model_validator(mode="after")
    def _check(self) -> Task:
        if self.request.request_id != self.task_id:
            raise ValueError(f"task id {self.task_id!r} differs from its request id "
                             f"{self.request.request_id!r}")
        return self


class ClusterState(Frozen):
    """last_event_idx is the index of the last applied event; None before the first one.

    session_master is the master whose session produced these events (set by SessionStarted).
    Who is master now is the election's business, not the state's.
    """

    nodes: dict[NodeId, NodeInfo] = Field(default_factory=dict)
    instances: dict[InstanceId, Instance] = Field(default_factory=dict)
    runners: dict[RunnerId, RunnerStatus] = Field(default_factory=dict)
    tasks: dict[RequestId, Task] = Field(default_factory=dict)
    session_master: NodeId | None = None
    last_event_idx: int | None = None
    # model (lower case) -> the nodes where a download or load of it failed, and why: left
    # out of its placements until a load there succeeds, the node leaves, or a placement
    # finds no other node (then every node is tried again).
    load_failures: dict[str, dict[NodeId, str]] = Field(default_factory=dict)

    def next_event_idx(self) -> int:
        return 0 if self.last_event_idx is None else self.last_event_idx + 1

    def instance_status(self, instance_id: InstanceId) -> InstanceStatus:
        """Derived from the ranks' runner statuses (KeyError for an unknown instance)."""
        instance = self.instances[instance_id]
        phases = [self.runners[r].phase if r in self.runners else None
                  for r in instance.runner_ids]
        if "failed" in phases:
            return "failed"
        if all(phase == "ready" for phase in phases):
            return "ready"
        if any(phase in ("loading", "ready") for phase in phases):
            return "loading"
        return "starting"

    def failed_nodes(self, model: str) -> dict[NodeId, str]:
        """The nodes where model's download or load failed, and why."""
        return dict(self.load_failures.get(model.lower(), {}))

    def instances_of(self, model: str) -> tuple[Instance, ...]:
        return tuple(i for i in self.instances.values() if i.model == model)

    def tasks_of(self, instance_id: InstanceId) -> tuple[Task, ...]:
        return tuple(t for t in self.tasks.values() if t.instance_id == instance_id)
