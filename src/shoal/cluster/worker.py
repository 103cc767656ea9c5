"""The worker's decision: plan(state, local) -> the one next action, or None. Pure.

`state` is the replicated ClusterState; `local` is this node's own, fresher view of its
runners and of what it already did with each task (events it sent may not have come back
indexed yet, so the state alone would make it repeat itself). The driver around plan()
performs the action, updates `local`, reports events, and calls plan() again.

Order matters: tearing down and aborting free resources and end client streams first, then
failing what cannot be served, then starting and feeding runners. A rank of a multi-rank
instance joins its process group before it loads any weight, so the group's rendezvous is
what makes the ranks load together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from shoal.cluster.instances import Instance, Rank
from shoal.cluster.state import ClusterState, RunnerPhase, Task
from shoal.ids import InstanceId, NodeId, RequestId, RunnerId
from shoal.protocol import ErrorCode

# What this node already did with a task; the driver drops entries once the task leaves
# the state.
TaskProgress = Literal["dispatched", "aborted", "failed"]


@dataclass(frozen=True)
class LocalRunner:
    runner_id: RunnerId
    instance_id: InstanceId
    phase: RunnerPhase


@dataclass(frozen=True)
class LocalView:
    node_id: NodeId
    runners: Mapping[RunnerId, LocalRunner] = field(default_factory=dict)
    task_progress: Mapping[RequestId, TaskProgress] = field(default_factory=dict)


@dataclass(frozen=True)
class StartRunner:
    """Start and load the runner of this node's rank; the driver first checks live memory
    and may refuse instead."""

    instance: Instance
    rank: Rank


@dataclass(frozen=True)
class TearDown:
    runner_id: RunnerId
    instance_id: InstanceId
    reason: str


@dataclass(frozen=True)
class DispatchTask:
    task: Task
    runner_id: RunnerId


@dataclass(frozen=True)
class AbortTask:
    """Stop a cancelled task; runner_id is None when it never reached a runner."""

    task_id: RequestId
    runner_id: RunnerId | None


@dataclass(frozen=True)
class FailTask:
    task_id: RequestId
    code: ErrorCode
    message: str


Action = StartRunner | TearDown | DispatchTask | AbortTask | FailTask


def plan(state: ClusterState, local: LocalView) -> Action | None:
    """The one next thing this node should do, or None when it is in step with the state."""
    return (_tear_down(state, local) or _abort_cancelled(state, local)
            or _fail_unservable(state, local) or _start_runner(state, local)
            or _dispatch(state, local))


def _tear_down(state: ClusterState, local: LocalView) -> TearDown | None:
    for runner in local.runners.values():
        instance = state.instances.get(runner.instance_id)
        if instance is None or runner.runner_id not in instance.runner_ids:
            return TearDown(runner.runner_id, runner.instance_id, "instance deleted")
    return None


def _served_here(state: ClusterState, local: LocalView) -> list[tuple[Task, Instance]]:
    """Tasks whose instance has its rank 0 (the serving rank) on this node, oldest first."""
    served = []
    for task in state.tasks.values():
        instance = state.instances.get(task.instance_id)
        if instance is not None and instance.ranks[0].node_id == local.node_id:
            served.append((task, instance))
    return served


def _abort_cancelled(state: ClusterState, local: LocalView) -> AbortTask | None:
    for task, instance in _served_here(state, local):
        progress = local.task_progress.get(task.task_id)
        if task.status == "cancelled" and progress not in ("aborted", "failed"):
            runner_id = instance.ranks[0].runner_id if progress == "dispatched" else None
            return AbortTask(task.task_id, runner_id)
    return None


def _fail_unservable(state: ClusterState, local: LocalView) -> FailTask | None:
    for task, instance in _served_here(state, local):
        if task.status != "active" or local.task_progress.get(task.task_id) == "failed":
            continue
        failed = _failed_rank(state, local, instance)
        if failed is not None:
            return FailTask(task.task_id, "unavailable",
                            f"model {instance.model!r} failed on node {failed.node_id}: "
                            f"{_failure_message(state, failed)}")
    return None


def _start_runner(state: ClusterState, local: LocalView) -> StartRunner | None:
    for instance in state.instances.values():
        rank = instance.rank_on(local.node_id)
        if rank is None or rank.runner_id in local.runners:
            continue
        # A runner the state says failed is not restarted: the master decides what next.
        reported = state.runners.get(rank.runner_id)
        if reported is not None and reported.phase == "failed":
            continue
        return StartRunner(instance, rank)
    return None


def _dispatch(state: ClusterState, local: LocalView) -> DispatchTask | None:
    for task, instance in _served_here(state, local):
        if task.status != "active" or task.task_id in local.task_progress:
            continue
        if all(_phase(state, local, rank) == "ready" for rank in instance.ranks):
            return DispatchTask(task, instance.ranks[0].runner_id)
    return None


def _phase(state: ClusterState, local: LocalView, rank: Rank) -> RunnerPhase | None:
    """A rank's phase: this node's own view for local ranks, the state's for the others."""
    if rank.node_id == local.node_id:
        runner = local.runners.get(rank.runner_id)
        return None if runner is None else runner.phase
    reported = state.runners.get(rank.runner_id)
    return None if reported is None else reported.phase


def _failed_rank(state: ClusterState, local: LocalView, instance: Instance) -> Rank | None:
    return next((r for r in instance.ranks if _phase(state, local, r) == "failed"), None)


def _failure_message(state: ClusterState, rank: Rank) -> str:
    reported = state.runners.get(rank.runner_id)
    return reported.message if reported is not None and reported.message else "runner failed"
