"""apply(): one test per event, contiguity, and replay equivalences."""

from __future__ import annotations

import typing

import pytest
from state_builders import indexed, node, pipeline, runner_status, single, task

from shoal.cluster.apply import _APPLIERS, EventOutOfOrder, apply, apply_all
from shoal.cluster.events import (
    Event,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    NodeJoined,
    NodeLeft,
    RunnerStatusChanged,
    SessionStarted,
    TaskCancelled,
    TaskCreated,
    TaskFailed,
    TaskFinished,
)
from shoal.cluster.state import ClusterState, NodeInfo

INSTANCE = pipeline("i1", [("a", 20), ("b", 32)])
OTHER = single("i2", on="b")


def state_after(*events) -> ClusterState:
    return apply_all(ClusterState(), indexed(events))


def step(state: ClusterState, event) -> ClusterState:
    return apply(state, IndexedEvent(idx=state.next_event_idx(), event=event))


def populated() -> ClusterState:
    """Two nodes, two instances, runner statuses and a task on each instance."""
    return state_after(
        NodeJoined(node=node("a")), NodeJoined(node=node("b")),
        InstanceCreated(instance=INSTANCE), InstanceCreated(instance=OTHER),
        RunnerStatusChanged(status=runner_status(INSTANCE, 0, "ready")),
        RunnerStatusChanged(status=runner_status(INSTANCE, 1, "loading")),
        RunnerStatusChanged(status=runner_status(OTHER, 0, "ready")),
        TaskCreated(task=task("t1", INSTANCE)), TaskCreated(task=task("t2", OTHER)))


def test_every_event_kind_has_an_applier():
    members = typing.get_args(typing.get_args(Event)[0])
    assert set(members) == set(_APPLIERS)


def test_indices_advance_one_by_one():
    state = populated()
    assert state.last_event_idx == 8
    assert state.next_event_idx() == 9


def test_first_event_must_be_zero():
    with pytest.raises(EventOutOfOrder) as raised:
        apply(ClusterState(), IndexedEvent(idx=1, event=NodeJoined(node=node("a"))))
    assert (raised.value.expected, raised.value.got) == (0, 1)


def test_gap_and_duplicate_are_refused_and_leave_state_untouched():
    state = state_after(NodeJoined(node=node("a")), NodeJoined(node=node("b")))
    for idx in (0, 1, 3):
        with pytest.raises(EventOutOfOrder):
            apply(state, IndexedEvent(idx=idx, event=NodeLeft(node_id="a")))
    assert set(state.nodes) == {"a", "b"} and state.last_event_idx == 1


def test_session_started_replaces_everything_but_nodes_and_instances():
    before = populated()
    after = step(before, SessionStarted(master_id="b", nodes=(node("b"),),
                                        instances=(OTHER,)))
    assert set(after.nodes) == {"b"}
    assert set(after.instances) == {"i2"}
    assert after.runners == {} and after.tasks == {}
    assert after.session_master == "b"
    assert after.last_event_idx == before.last_event_idx + 1


def test_session_started_as_a_new_sessions_first_event():
    state = apply(ClusterState(), IndexedEvent(idx=0, event=SessionStarted(master_id="a")))
    assert state.session_master == "a" and state.last_event_idx == 0


def test_node_joined_adds_and_a_rejoin_replaces():
    state = state_after(NodeJoined(node=node("a")))
    assert state.nodes["a"].addresses == ("a.local:8470",)
    moved = NodeInfo(node_id="a", name="a", addresses=("10.0.0.9:8470",))
    assert step(state, NodeJoined(node=moved)).nodes["a"] == moved


def test_node_left_drops_the_node_and_its_runner_statuses_but_not_instances():
    state = step(populated(), NodeLeft(node_id="b"))
    assert set(state.nodes) == {"a"}
    assert set(state.runners) == {INSTANCE.ranks[0].runner_id}
    assert set(state.instances) == {"i1", "i2"}  # the master deletes them, not apply


def test_node_left_for_an_unknown_node_changes_nothing_but_the_index():
    before = populated()
    after = step(before, NodeLeft(node_id="zz"))
    assert after.model_copy(update={"last_event_idx": before.last_event_idx}) == before


def test_instance_created():
    state = state_after(InstanceCreated(instance=INSTANCE))
    assert state.instances == {"i1": INSTANCE}
    assert state.instance_status("i1") == "starting"


def test_instance_deleted_drops_its_runner_statuses_only():
    state = step(populated(), InstanceDeleted(instance_id="i1", reason="operator"))
    assert set(state.instances) == {"i2"}
    assert set(state.runners) == {OTHER.ranks[0].runner_id}
    assert set(state.tasks) == {"t1", "t2"}  # the master fails orphaned tasks explicitly


def test_a_late_runner_status_cannot_resurrect_a_deleted_instance():
    state = step(populated(), InstanceDeleted(instance_id="i1"))
    state = step(state, RunnerStatusChanged(status=runner_status(INSTANCE, 0, "ready")))
    assert INSTANCE.ranks[0].runner_id not in state.runners


def test_runner_status_changed_updates_and_stopped_removes():
    state = populated()
    rid = INSTANCE.ranks[1].runner_id
    state = step(state, RunnerStatusChanged(status=runner_status(INSTANCE, 1, "ready")))
    assert state.runners[rid].phase == "ready"
    assert state.instance_status("i1") == "ready"
    state = step(state, RunnerStatusChanged(status=runner_status(INSTANCE, 1, "stopped")))
    assert rid not in state.runners
    assert state.instance_status("i1") == "loading"


def test_runner_status_for_a_runner_outside_the_instance_is_ignored():
    stray = runner_status(INSTANCE, 0, "ready").model_copy(update={"runner_id": "i1.r7"})
    state = step(populated(), RunnerStatusChanged(status=stray))
    assert "i1.r7" not in state.runners


def test_instance_status_is_derived_from_its_ranks():
    state = state_after(InstanceCreated(instance=INSTANCE))
    assert state.instance_status("i1") == "starting"
    state = step(state, RunnerStatusChanged(status=runner_status(INSTANCE, 0, "loading")))
    assert state.instance_status("i1") == "loading"
    state = step(state, RunnerStatusChanged(status=runner_status(INSTANCE, 1, "failed", "OOM")))
    assert state.instance_status("i1") == "failed"


def test_task_created_cancelled_finished_failed():
    state = state_after(InstanceCreated(instance=INSTANCE), TaskCreated(task=task("t1", INSTANCE)),
                        TaskCreated(task=task("t2", INSTANCE)))
    assert [t.status for t in state.tasks.values()] == ["active", "active"]
    state = step(state, TaskCancelled(task_id="t1"))
    assert state.tasks["t1"].status == "cancelled" and state.tasks["t2"].status == "active"
    state = step(state, TaskFinished(task_id="t1"))
    assert set(state.tasks) == {"t2"}
    state = step(state, TaskFailed(task_id="t2", code="unavailable", message="gone"))
    assert state.tasks == {}


def test_task_events_for_unknown_tasks_are_no_ops():
    before = populated()
    after = apply_all(before, indexed([TaskCancelled(task_id="nope"), TaskFinished(task_id="nope")],
                                      start=before.next_event_idx()))
    assert after.tasks == before.tasks


def test_apply_never_mutates_its_input():
    before = populated()
    snapshot = before.model_dump()
    step(before, InstanceDeleted(instance_id="i1"))
    step(before, TaskFinished(task_id="t1"))
    assert before.model_dump() == snapshot


def test_snapshot_plus_tail_equals_full_replay():
    events = indexed([
        NodeJoined(node=node("a")), NodeJoined(node=node("b")),
        InstanceCreated(instance=INSTANCE), TaskCreated(task=task("t1", INSTANCE)),
        RunnerStatusChanged(status=runner_status(INSTANCE, 0, "ready")),
        TaskFinished(task_id="t1"), NodeLeft(node_id="b"), InstanceDeleted(instance_id="i1")])
    full = apply_all(ClusterState(), events)
    for cut in range(len(events) + 1):
        snapshot = ClusterState.model_validate_json(
            apply_all(ClusterState(), events[:cut]).model_dump_json())
        assert apply_all(snapshot, events[cut:]) == full
