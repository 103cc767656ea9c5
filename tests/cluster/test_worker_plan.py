"""plan(): the worker's next action, walked through whole lifecycles step by step."""

from __future__ import annotations

from state_builders import indexed, node, pipeline, runner_status, single, task

from shoal.cluster.apply import apply_all
from shoal.cluster.events import (
    InstanceCreated,
    InstanceDeleted,
    NodeJoined,
    RunnerStatusChanged,
    TaskCancelled,
    TaskCreated,
)
from shoal.cluster.state import ClusterState
from shoal.cluster.worker import (
    AbortTask,
    DispatchTask,
    FailTask,
    LocalRunner,
    LocalView,
    StartRunner,
    TearDown,
    plan,
)

SOLO = single("i1", on="a")
SPLIT = pipeline("i2", [("a", 16), ("b", 32)])


def state_of(*events) -> ClusterState:
    return apply_all(ClusterState(), indexed([NodeJoined(node=node("a")),
                                              NodeJoined(node=node("b")), *events]))


def with_runner(view: LocalView, instance, phase: str, rank: int = 0) -> LocalView:
    rid = instance.ranks[rank].runner_id
    runners = {**view.runners, rid: LocalRunner(rid, instance.instance_id, phase)}
    return LocalView(view.node_id, runners, view.task_progress)


def with_progress(view: LocalView, task_id: str, progress: str) -> LocalView:
    return LocalView(view.node_id, view.runners, {**view.task_progress, task_id: progress})


def test_idle_node_with_nothing_placed_does_nothing():
    assert plan(state_of(), LocalView("a")) is None


def test_single_node_lifecycle_start_load_dispatch():
    state = state_of(InstanceCreated(instance=SOLO), TaskCreated(task=task("t1", SOLO)))
    local = LocalView("a")
    assert plan(state, local) == StartRunner(SOLO, SOLO.ranks[0])
    local = with_runner(local, SOLO, "loading")
    assert plan(state, local) is None
    local = with_runner(local, SOLO, "ready")
    assert plan(state, local) == DispatchTask(state.tasks["t1"], SOLO.ranks[0].runner_id)
    local = with_progress(local, "t1", "dispatched")
    assert plan(state, local) is None  # not dispatched twice while TaskFinished is in flight


def test_tasks_are_dispatched_oldest_first():
    state = state_of(InstanceCreated(instance=SOLO), TaskCreated(task=task("t1", SOLO)),
                     TaskCreated(task=task("t2", SOLO)))
    local = with_runner(LocalView("a"), SOLO, "ready")
    assert plan(state, local).task.task_id == "t1"
    assert plan(state, with_progress(local, "t1", "dispatched")).task.task_id == "t2"


def test_other_nodes_do_nothing_for_an_instance_they_hold_no_rank_of():
    state = state_of(InstanceCreated(instance=SOLO), TaskCreated(task=task("t1", SOLO)))
    assert plan(state, LocalView("b")) is None


def test_cancelled_dispatched_task_is_aborted_on_its_runner_once():
    state = state_of(InstanceCreated(instance=SOLO), TaskCreated(task=task("t1", SOLO)),
                     TaskCancelled(task_id="t1"))
    local = with_progress(with_runner(LocalView("a"), SOLO, "ready"), "t1", "dispatched")
    assert plan(state, local) == AbortTask("t1", SOLO.ranks[0].runner_id)
    assert plan(state, with_progress(local, "t1", "aborted")) is None


def test_cancelled_task_never_dispatched_is_aborted_without_a_runner():
    state = state_of(InstanceCreated(instance=SOLO), TaskCreated(task=task("t1", SOLO)),
                     TaskCancelled(task_id="t1"))
    local = with_runner(LocalView("a"), SOLO, "loading")
    assert plan(state, local) == AbortTask("t1", None)


def test_deleted_instance_is_torn_down_before_anything_else():
    state = state_of(InstanceCreated(instance=SOLO), InstanceCreated(instance=SPLIT),
                     InstanceDeleted(instance_id="i1"))
    local = with_runner(LocalView("a"), SOLO, "ready")
    assert plan(state, local) == TearDown(SOLO.ranks[0].runner_id, "i1", "instance deleted")
    # Once torn down, the node goes on with the remaining instance.
    assert plan(state, LocalView("a")) == StartRunner(SPLIT, SPLIT.ranks[0])


def test_a_failed_local_runner_fails_its_tasks_and_is_not_restarted():
    state = state_of(InstanceCreated(instance=SOLO), TaskCreated(task=task("t1", SOLO)))
    local = with_progress(with_runner(LocalView("a"), SOLO, "failed"), "t1", "dispatched")
    action = plan(state, local)
    assert isinstance(action, FailTask) and action.task_id == "t1"
    assert action.code == "unavailable" and "node a" in action.message
    assert plan(state, with_progress(local, "t1", "failed")) is None


def test_a_runner_the_state_reports_failed_is_not_restarted_after_a_worker_restart():
    state = state_of(InstanceCreated(instance=SOLO),
                     RunnerStatusChanged(status=runner_status(SOLO, 0, "failed", "bad weights")))
    assert plan(state, LocalView("a")) is None


def test_each_node_starts_its_own_rank_of_a_pipeline():
    state = state_of(InstanceCreated(instance=SPLIT))
    assert plan(state, LocalView("b")) == StartRunner(SPLIT, SPLIT.ranks[1])
    assert plan(state, LocalView("a")) == StartRunner(SPLIT, SPLIT.ranks[0])
    assert plan(state, with_runner(LocalView("b"), SPLIT, "loading", rank=1)) is None


def test_only_rank_zero_serves_and_waits_for_every_rank_ready():
    state = state_of(InstanceCreated(instance=SPLIT), TaskCreated(task=task("t1", SPLIT)),
                     RunnerStatusChanged(status=runner_status(SPLIT, 1, "loading")))
    local_a = with_runner(LocalView("a"), SPLIT, "ready", rank=0)
    assert plan(state, local_a) is None
    local_b = with_runner(LocalView("b"), SPLIT, "ready", rank=1)
    assert plan(state, local_b) is None  # rank 1 never dispatches
    state = apply_all(state, indexed([RunnerStatusChanged(status=runner_status(SPLIT, 1, "ready"))],
                                     start=state.next_event_idx()))
    assert plan(state, local_a) == DispatchTask(state.tasks["t1"], SPLIT.ranks[0].runner_id)


def test_a_failed_peer_rank_fails_the_tasks_rank_zero_serves():
    state = state_of(InstanceCreated(instance=SPLIT), TaskCreated(task=task("t1", SPLIT)),
                     RunnerStatusChanged(status=runner_status(SPLIT, 1, "failed", "out of memory")))
    local_a = with_runner(LocalView("a"), SPLIT, "ready", rank=0)
    action = plan(state, local_a)
    assert isinstance(action, FailTask) and "out of memory" in action.message
