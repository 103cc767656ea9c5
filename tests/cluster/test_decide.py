"""The master's pure decisions: (state, input, facts) -> events, no clock, no transport."""

from __future__ import annotations

import logging

from state_builders import facts, indexed, node, runner_status, single, task

from shoal.cluster import decide
from shoal.cluster.apply import apply_all
from shoal.cluster.decide import Facts
from shoal.cluster.events import (
    CancelTask,
    DeleteInstance,
    InstanceCreated,
    InstanceDeleted,
    NodeJoined,
    NodeLeft,
    PlaceInstance,
    PlacementFailed,
    RefusePlacement,
    RunnerStatusChanged,
    SessionStarted,
    SubmitTask,
    TaskCancelled,
    TaskCreated,
    TaskFailed,
)
from shoal.cluster.instances import PlacementRequest
from shoal.cluster.placement import DEFAULT_POLICY
from shoal.cluster.state import ClusterState
from shoal.cluster.telemetry import NodeReading
from shoal.ids import CommandId, InstanceId, NodeId
from shoal.protocol import GenerationRequest

MIB = 2**20
SMALL = facts(model="small", weight_bytes=100 * MIB, n_layers=4, n_heads=4, n_kv_heads=2,
              head_dim=16, intermediate_size=64)


def reading(name: str, slots: int | None = None, budget: int = 8 * 2**30) -> NodeReading:
    return NodeReading(node_id=NodeId(name), taken_at=0, name=name,
                       addresses=(f"{name}.local:8470",), memory_budget=budget,
                       max_loaded_models=slots)


def facts_of(*readings: NodeReading, seed: int = 7, settled: bool = True) -> Facts:
    return Facts(readings={r.node_id: r for r in readings}, policy=DEFAULT_POLICY,
                 max_replacements=2, rendezvous_ports=(29500, 32768), seed=seed,
                 settled=settled)


def state_of(*events) -> ClusterState:
    return apply_all(ClusterState(), indexed(events))


def placed(instance_id: str, on: str, **request) -> object:
    instance = single(instance_id, on, SMALL)
    return instance.model_copy(update={"request": PlacementRequest(facts=SMALL, **request)})


def place_command(**request) -> PlaceInstance:
    return PlaceInstance(command_id=CommandId("c1"),
                         request=PlacementRequest(facts=SMALL, **request))


def kinds(decision) -> list[str]:
    return [type(e).__name__ for e in decision.events]


def test_a_decision_depends_only_on_its_inputs():
    state = state_of(SessionStarted(master_id=NodeId("a"), nodes=(node("a"), node("b"))))
    inputs = facts_of(reading("a"), reading("b"))
    first = decide.on_command(state, place_command(), inputs)
    again = decide.on_command(state, place_command(), inputs)
    assert first.events == again.events and kinds(first) == ["InstanceCreated"]
    other = decide.on_command(state, place_command(), facts_of(reading("a"), reading("b"),
                                                               seed=8))
    assert other.events[0].instance.instance_id != first.events[0].instance.instance_id
    # Deciding never changes the state it was given.
    assert state == state_of(SessionStarted(master_id=NodeId("a"),
                                            nodes=(node("a"), node("b"))))


def test_a_placement_goes_to_the_preferred_node_and_answers_its_command():
    state = state_of(SessionStarted(master_id=NodeId("a"), nodes=(node("a"), node("b"))))
    decision = decide.on_command(state, place_command(preferred_node=NodeId("b")),
                                 facts_of(reading("a"), reading("b")))
    created = decision.events[0]
    assert isinstance(created, InstanceCreated) and created.command_id == "c1"
    assert created.instance.node_ids == ("b",)
    assert any(level == logging.INFO and "placing small" in text
               for level, text in decision.notes)


def test_a_placement_that_fits_nowhere_fails_its_command_with_the_reason():
    state = state_of(SessionStarted(master_id=NodeId("a"), nodes=(node("a"),)),
                     InstanceCreated(instance=single("x", "a", SMALL)))
    decision = decide.on_command(state, place_command(), facts_of(reading("a", slots=1)))
    assert kinds(decision) == ["PlacementFailed"]
    failed = decision.events[0]
    assert isinstance(failed, PlacementFailed) and "max-loaded-models" in failed.reason
    assert any(level == logging.WARNING for level, _ in decision.notes)


def test_a_failed_runner_s_replacement_sees_the_memory_its_predecessor_frees():
    # One node with room for one model: the replacement fits only once the failed
    # instance is counted out, and its task fails with the runner's message.
    x = placed("x", "a")
    state = state_of(SessionStarted(master_id=NodeId("a"), nodes=(node("a"),)),
                     InstanceCreated(instance=x), TaskCreated(task=task("t1", x)))
    report = RunnerStatusChanged(status=runner_status(x, 0, "failed", "out of memory"))
    decision = decide.on_worker_event(state, report, facts_of(reading("a", slots=1)))
    assert kinds(decision) == ["RunnerStatusChanged", "TaskFailed", "InstanceDeleted",
                               "InstanceCreated"]
    assert "out of memory" in decision.events[1].message
    replacement = decision.events[3].instance
    assert replacement.node_ids == ("a",) and replacement.attempt == 1
    after = apply_all(state, indexed(decision.events, start=state.next_event_idx()))
    assert list(after.instances) == [replacement.instance_id] and not after.tasks


def test_a_failed_on_demand_instance_is_deleted_and_a_bounded_one_gives_up():
    on_demand = placed("x", "a", on_demand=True)
    state = state_of(SessionStarted(master_id=NodeId("a"), nodes=(node("a"),)),
                     InstanceCreated(instance=on_demand))
    report = RunnerStatusChanged(status=runner_status(on_demand, 0, "failed"))
    assert kinds(decide.on_worker_event(state, report, facts_of(reading("a")))) == [
        "RunnerStatusChanged", "InstanceDeleted"]
    worn = placed("y", "a").model_copy(update={"attempt": 2})
    state = state_of(SessionStarted(master_id=NodeId("a"), nodes=(node("a"),)),
                     InstanceCreated(instance=worn))
    decision = decide.on_worker_event(
        state, RunnerStatusChanged(status=runner_status(worn, 0, "failed")),
        facts_of(reading("a")))
    assert kinds(decision) == ["RunnerStatusChanged", "InstanceDeleted"]
    assert any("not placing it again" in text for _, text in decision.notes)


def test_reconcile_admits_nodes_then_after_settling_removes_the_silent():
    lost = placed("lost", "b")
    requested = placed("asked", "b", on_demand=True)
    state = state_of(SessionStarted(master_id=NodeId("a"), nodes=(node("a"), node("b")),
                                    instances=(lost, requested)))
    joining = reading("c")
    unsettled = decide.reconcile(state, facts_of(reading("a"), joining, settled=False))
    assert kinds(unsettled) == ["NodeJoined"]
    assert unsettled.events[0].node.node_id == "c"
    decision = decide.reconcile(state, facts_of(reading("a"), joining))
    assert kinds(decision) == ["NodeJoined", "NodeLeft", "InstanceDeleted", "InstanceDeleted",
                               "InstanceCreated"]
    left = decision.events[1]
    assert isinstance(left, NodeLeft) and left.node_id == "b"
    deleted = {e.instance_id: e.reason for e in decision.events
               if isinstance(e, InstanceDeleted)}
    assert set(deleted) == {"lost", "asked"} and "node b left" in deleted["lost"]
    # Only the instance not placed for requests is placed again, on a live node.
    created = decision.events[-1].instance
    assert created.model == "small" and created.node_ids[0] in ("a", "c")


def test_a_departed_node_leaves_at_once_but_a_silent_one_waits_for_the_grace():
    on_b = placed("x", "b")
    state = state_of(SessionStarted(master_id=NodeId("a"),
                                    nodes=(node("a"), node("b"), node("c")), instances=(on_b,)))
    # b's presence is gone (its process died); c is present but has not reported yet.
    inputs = facts_of(reading("a"), reading("b"), settled=False)
    departed = Facts(**{**inputs.__dict__, "departed": frozenset({NodeId("b")})})
    decision = decide.reconcile(state, departed)
    left = [e for e in decision.events if isinstance(e, NodeLeft)]
    assert [(e.node_id, e.reason) for e in left] == [("b", "disconnected")]
    assert not any(isinstance(e, NodeJoined) for e in decision.events)  # b's stale reading
    assert kinds(decision)[-2:] == ["InstanceDeleted", "InstanceCreated"]
    assert decision.events[-1].instance.node_ids == ("a",)


def test_instances_lost_together_are_planned_together_without_overbooking():
    one, two = placed("one", "b"), placed("two", "b")
    state = state_of(SessionStarted(master_id=NodeId("a"), nodes=(node("a"), node("b")),
                                    instances=(one, two)))
    decision = decide.reconcile(state, facts_of(reading("a", slots=1)))
    assert kinds(decision).count("InstanceCreated") == 1
    assert any("cannot place model small" in text for _, text in decision.notes)


def test_a_refused_placement_is_placed_one_node_wider():
    model = facts(model="big", weight_bytes=100 * MIB, n_layers=4, n_heads=4, n_kv_heads=2,
                  head_dim=16, intermediate_size=64)
    x = single("x", "a", model)
    state = state_of(SessionStarted(master_id=NodeId("a"), nodes=(node("a"), node("b")),
                                    instances=(x,)))
    refusal = RefusePlacement(command_id=CommandId("r"), instance_id=InstanceId("x"), node_id=NodeId("a"),
                              reason="not enough memory")
    decision = decide.on_command(state, refusal, facts_of(reading("a"), reading("b")))
    assert kinds(decision) == ["InstanceDeleted", "InstanceCreated"]
    assert "cannot fit its share" in decision.events[0].reason
    wider = decision.events[1].instance
    assert len(wider.ranks) == 2 and wider.rendezvous is not None
    assert wider.rendezvous.host == "a.local" and 29500 <= wider.rendezvous.port < 32768
    # A repeated refusal is moot once the instance is gone.
    after = apply_all(state, indexed(decision.events, start=state.next_event_idx()))
    assert decide.on_command(after, refusal, facts_of(reading("a"))).events == []


def test_tasks_are_created_once_cancelled_once_and_fail_for_a_missing_instance():
    x = placed("x", "a")
    state = state_of(SessionStarted(master_id=NodeId("a"), nodes=(node("a"),)),
                     InstanceCreated(instance=x))
    request = GenerationRequest(request_id="t1", model="small", prompt="hi")
    submit = SubmitTask(command_id=CommandId("c"), instance_id=InstanceId("x"),
                        owner_node=NodeId("a"), request=request)
    inputs = facts_of(reading("a"))
    created = decide.on_command(state, submit, inputs)
    assert kinds(created) == ["TaskCreated"]
    state = apply_all(state, indexed(created.events, start=state.next_event_idx()))
    assert decide.on_command(state, submit, inputs).events == []
    cancel = CancelTask(command_id=CommandId("k"), task_id="t1")
    cancelled = decide.on_command(state, cancel, inputs)
    assert isinstance(cancelled.events[0], TaskCancelled)
    state = apply_all(state, indexed(cancelled.events, start=state.next_event_idx()))
    assert decide.on_command(state, cancel, inputs).events == []
    missing = submit.model_copy(update={"instance_id": InstanceId("gone"),
                                        "request": request.model_copy(
                                            update={"request_id": "t2"})})
    failed = decide.on_command(state, missing, inputs).events
    assert isinstance(failed[0], TaskFailed) and "does not exist" in failed[0].message
    assert decide.on_command(state, DeleteInstance(command_id=CommandId("d"),
                                                   instance_id=InstanceId("gone"),
                                                   reason="r"), inputs).events == []


def test_a_session_carries_nodes_and_instances_and_fails_tasks_in_flight():
    x = placed("x", "a")
    seed = state_of(SessionStarted(master_id=NodeId("a"), nodes=(node("a"),)),
                    InstanceCreated(instance=x), TaskCreated(task=task("t1", x)))
    events = decide.begin_session(seed, NodeId("b"))
    assert isinstance(events[0], SessionStarted) and events[0].instances == (x,)
    assert isinstance(events[1], TaskFailed) and "master changed (now b)" in events[1].message
    assert not any(isinstance(e, NodeJoined) for e in events)


def test_a_node_where_a_model_failed_to_load_is_left_out_of_its_next_placements():
    # a has the most memory, so without the failure everything would go there.
    x = placed("x", "a")
    state = state_of(SessionStarted(master_id=NodeId("a"), nodes=(node("a"), node("b"))),
                     InstanceCreated(instance=x))
    inputs = facts_of(reading("a", budget=16 * 2**30), reading("b"))
    later = facts_of(reading("a", budget=16 * 2**30), reading("b"), seed=8)  # other ids
    report = RunnerStatusChanged(status=runner_status(x, 0, "failed", "disk full"))
    decision = decide.on_worker_event(state, report, inputs)
    replacement = decision.events[-1].instance
    assert replacement.node_ids == ("b",) and replacement.attempt == 1
    after = apply_all(state, indexed(decision.events, start=state.next_event_idx()))
    assert after.failed_nodes("SMALL") == {"a": "disk full"}
    # A request placing it now also avoids a; a load there that succeeds clears it.
    placed_now = decide.on_command(after, place_command(), later).events
    assert placed_now[0].instance.node_ids == ("b",)
    ready_on_a = RunnerStatusChanged(status=runner_status(placed("z", "a"), 0, "ready"))
    cleared = apply_all(after, indexed([InstanceCreated(instance=placed("z", "a")),
                                        ready_on_a], start=after.next_event_idx()))
    assert cleared.failed_nodes("small") == {}


def test_where_a_model_failed_to_load_survives_a_change_of_master():
    x = placed("x", "a")
    state = state_of(SessionStarted(master_id=NodeId("a"), nodes=(node("a"), node("b"))),
                     InstanceCreated(instance=x),
                     RunnerStatusChanged(status=runner_status(x, 0, "failed", "disk full")))
    # The new master's session carries the failure in its first event, so its log (and
    # every replica folding it) leaves a out of the model's next placement too.
    events = decide.begin_session(state, NodeId("b"))
    carried = apply_all(state, indexed(events, start=state.next_event_idx()))
    assert carried.session_master == "b" and carried.failed_nodes("small") == {"a": "disk full"}
    from_the_log = state_of(*events)  # a node that joins now, from the new log alone
    assert from_the_log.failed_nodes("SMALL") == {"a": "disk full"}
    inputs = facts_of(reading("a", budget=16 * 2**30), reading("b"), seed=8)
    assert decide.on_command(carried, place_command(), inputs).events[0].instance.node_ids \
        == ("b",)


def test_when_it_failed_everywhere_it_is_tried_again_and_a_refusal_says_where_it_failed():
    x = placed("x", "a")
    state = state_of(SessionStarted(master_id=NodeId("a"), nodes=(node("a"),)),
                     InstanceCreated(instance=x),
                     RunnerStatusChanged(status=runner_status(x, 0, "failed", "disk full")))
    assert state.failed_nodes("small") == {"a": "disk full"}
    # Only a: tried there again rather than never.
    retried = decide.on_command(state, place_command(), facts_of(reading("a"), seed=8)).events
    assert retried[-1].instance.node_ids == ("a",)
    # No room anywhere: the refusal names the failure, and the failures are forgotten.
    full = decide.on_command(state, place_command(), facts_of(reading("a", slots=0))).events
    refused = full[-1]
    assert isinstance(refused, PlacementFailed) and "failed before on node a: disk full" \
        in refused.reason
    after = apply_all(state, indexed(full, start=state.next_event_idx()))
    assert after.failed_nodes("small") == {}
