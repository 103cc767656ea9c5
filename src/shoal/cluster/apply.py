"""apply(state, indexed_event) -> state: the only way ClusterState changes. Pure.

Events arrive with contiguous indices from 0; a gap or a repeat raises EventOutOfOrder (the
caller resyncs from a snapshot). Events that name something already gone are no-ops: a late
runner status can race its instance's deletion, and replay must never resurrect it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from shoal.cluster.events import (
    Event,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    NodeJoined,
    NodeLeft,
    PlacementFailed,
    RunnerStatusChanged,
    SessionStarted,
    TaskCancelled,
    TaskCreated,
    TaskFailed,
    TaskFinished,
)
from shoal.cluster.state import ClusterState
from shoal.ids import NodeId


class EventOutOfOrder(ValueError):
    """An event's index is not the one after the state's last applied index."""

    def __init__(self, expected: int, got: int) -> None:
        super().__init__(f"expected event {expected}, got event {got}")
        self.expected = expected
        self.got = got


def apply(state: ClusterState, indexed: IndexedEvent) -> ClusterState:
    """The state after one event; raises EventOutOfOrder unless indexed.idx is the next index."""
    expected = state.next_event_idx()
    if indexed.idx != expected:
        raise EventOutOfOrder(expected, indexed.idx)
    event = indexed.event
    new_state = _APPLIERS[type(event)](state, event)
    return new_state.model_copy(update={"last_event_idx": indexed.idx})


def apply_all(state: ClusterState, events: Iterable[IndexedEvent]) -> ClusterState:
    """Fold events into state: a snapshot plus a log tail gives the current state."""
    for indexed in events:
        state = apply(state, indexed)
    return state


def _session_started(state: ClusterState, event: SessionStarted) -> ClusterState:
    failures: dict[str, dict[NodeId, str]] = {}
    for failure in event.load_failures:
        if any(node.node_id == failure.node_id for node in event.nodes):
            failures.setdefault(failure.model.lower(), {})[failure.node_id] = failure.reason
    return ClusterState(
        nodes={node.node_id: node for node in event.nodes},
        instances={instance.instance_id: instance for instance in event.instances},
        session_master=event.master_id,
        last_event_idx=state.last_event_idx,
        load_failures=failures)


def _node_joined(state: ClusterState, event: NodeJoined) -> ClusterState:
    # A re-join replaces the old record (its addresses may have changed).
    nodes = {**state.nodes, event.node.node_id: event.node}
    return state.model_copy(update={"nodes": nodes})


def _node_left(state: ClusterState, event: NodeLeft) -> ClusterState:
    # Instances with ranks there stay until the master deletes them: it decides, not apply.
    nodes = {k: v for k, v in state.nodes.items() if k != event.node_id}
    runners = {k: v for k, v in state.runners.items() if v.node_id != event.node_id}
    failures = {model: left for model, failed in state.load_failures.items()
                if (left := {n: why for n, why in failed.items() if n != event.node_id})}
    return state.model_copy(update={"nodes": nodes, "runners": runners,
                                    "load_failures": failures})


def _instance_created(state: ClusterState, event: InstanceCreated) -> ClusterState:
    instance = event.instance
    return state.model_copy(update={"instances": {**state.instances,
                                                  instance.instance_id: instance}})


def _instance_deleted(state: ClusterState, event: InstanceDeleted) -> ClusterState:
    gone = state.instances.get(event.instance_id)
    if gone is None:
        return state
    instances = {k: v for k, v in state.instances.items() if k != event.instance_id}
    runners = {k: v for k, v in state.runners.items() if k not in gone.runner_ids}
    return state.model_copy(update={"instances": instances, "runners": runners})


def _placement_failed(state: ClusterState, event: PlacementFailed) -> ClusterState:
    # Nothing was placed. The nodes where the model failed get another chance next time:
    # a placement leaving them out found nowhere else (or failed for another reason).
    failures = {k: v for k, v in state.load_failures.items() if k != event.model.lower()}
    return state.model_copy(update={"load_failures": failures})


def _runner_status_changed(state: ClusterState, event: RunnerStatusChanged) -> ClusterState:
    status = event.status
    instance = state.instances.get(status.instance_id)
    if instance is None or status.runner_id not in instance.runner_ids:
        return state  # late news about a runner whose instance is gone
    if status.phase == "stopped":
        runners = {k: v for k, v in state.runners.items() if k != status.runner_id}
    else:
        runners = {**state.runners, status.runner_id: status}
    model = instance.model.lower()
    failed = dict(state.load_failures.get(model, {}))
    if status.phase == "failed":  # its download or load failed there: placed elsewhere next
        failed[status.node_id] = status.message or "its runner failed"
    elif status.phase == "ready":
        failed.pop(status.node_id, None)
    failures = {k: v for k, v in state.load_failures.items() if k != model}
    if failed:
        failures[model] = failed
    return state.model_copy(update={"runners": runners, "load_failures": failures})


def _task_created(state: ClusterState, event: TaskCreated) -> ClusterState:
    task = event.task
    return state.model_copy(update={"tasks": {**state.tasks, task.task_id: task}})


def _task_cancelled(state: ClusterState, event: TaskCancelled) -> ClusterState:
    task = state.tasks.get(event.task_id)
    if task is None:
        return state
    cancelled = task.model_copy(update={"status": "cancelled"})
    return state.model_copy(update={"tasks": {**state.tasks, task.task_id: cancelled}})


def _task_removed(state: ClusterState, event: TaskFinished | TaskFailed) -> ClusterState:
    tasks = {k: v for k, v in state.tasks.items() if k != event.task_id}
    return state.model_copy(update={"tasks": tasks})


_APPLIERS: dict[type, Callable[[ClusterState, Event], ClusterState]] = {
    SessionStarted: _session_started,
    NodeJoined: _node_joined,
    NodeLeft: _node_left,
    InstanceCreated: _instance_created,
    InstanceDeleted: _instance_deleted,
    PlacementFailed: _placement_failed,
    RunnerStatusChanged: _runner_status_changed,
    TaskCreated: _task_created,
    TaskCancelled: _task_cancelled,
    TaskFinished: _task_removed,
    TaskFailed: _task_removed,
}
