"""Wire types: every command and event survives msgpack; bad shapes are refused."""

from __future__ import annotations

import msgpack
import pydantic
import pytest
from state_builders import facts, node, pipeline, runner_status, task

from shoal.cluster.events import (
    CancelTask,
    DeleteInstance,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    NodeJoined,
    NodeLeft,
    PlaceInstance,
    RefusePlacement,
    RunnerStatusChanged,
    SessionStarted,
    SubmitTask,
    TaskCancelled,
    TaskCreated,
    TaskFailed,
    TaskFinished,
    parse_command,
    parse_event,
    parse_indexed_event,
    parse_worker_event,
    to_wire,
)
from shoal.cluster.instances import Instance, PlacementRequest, Rank, Rendezvous
from shoal.cluster.state import ClusterState, Task
from shoal.engine.sampling import SamplingParams
from shoal.protocol import ChatMessage, GenerationRequest

INSTANCE = pipeline("i1", [("a", 10), ("b", 32)])
REQUEST = GenerationRequest(
    request_id="r1", model="tiny", messages=(ChatMessage(role="user", content="hi"),),
    sampling=SamplingParams(temperature=0.5, max_tokens=7, logit_bias={42: -3.0}))

COMMANDS = [
    PlaceInstance(command_id="c1", request=PlacementRequest(
        facts=facts(), sharding="tensor", min_nodes=2, excluded_nodes=("c",))),
    DeleteInstance(command_id="c2", instance_id="i1"),
    RefusePlacement(command_id="c3", instance_id="i1", node_id="b", reason="2 GiB short"),
    SubmitTask(command_id="c4", instance_id="i1", owner_node="a", request=REQUEST),
    CancelTask(command_id="c5", task_id="r1"),
]
EVENTS = [
    SessionStarted(master_id="a", nodes=(node("a"),), instances=(INSTANCE,)),
    NodeJoined(node=node("b")),
    NodeLeft(node_id="b", reason="shutdown"),
    InstanceCreated(instance=INSTANCE),
    InstanceDeleted(instance_id="i1", reason="refused"),
    RunnerStatusChanged(status=runner_status(INSTANCE, 1, "failed", "out of memory")),
    TaskCreated(task=Task(task_id="r1", instance_id="i1", owner_node="a", request=REQUEST)),
    TaskCancelled(task_id="r1"),
    TaskFinished(task_id="r1"),
    TaskFailed(task_id="r1", code="unavailable", message="instance gone"),
]


def through_msgpack(message) -> object:
    return msgpack.unpackb(msgpack.packb(to_wire(message), use_bin_type=True), raw=False)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.kind)
def test_commands_round_trip(command):
    assert parse_command(through_msgpack(command)) == command


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.kind)
def test_events_round_trip_bare_and_indexed(event):
    assert parse_event(through_msgpack(event)) == event
    wrapped = IndexedEvent(idx=41, event=event)
    assert parse_indexed_event(through_msgpack(wrapped)) == wrapped


def test_cluster_state_json_round_trip():
    state = ClusterState(
        nodes={"a": node("a"), "b": node("b")}, instances={"i1": INSTANCE},
        runners={INSTANCE.ranks[0].runner_id: runner_status(INSTANCE, 0, "ready")},
        tasks={"t1": task("t1", INSTANCE)}, session_master="a", last_event_idx=12)
    assert ClusterState.model_validate_json(state.model_dump_json()) == state
    assert ClusterState.model_validate(through_msgpack(state)) == state


def test_worker_events_exclude_what_only_the_master_decides():
    assert parse_worker_event(to_wire(TaskFinished(task_id="r1"))) == TaskFinished(task_id="r1")
    with pytest.raises(pydantic.ValidationError):
        parse_worker_event(to_wire(InstanceCreated(instance=INSTANCE)))


def test_unknown_kind_extra_fields_and_negative_index_are_refused():
    with pytest.raises(pydantic.ValidationError):
        parse_event({"kind": "node_exploded", "node_id": "a"})
    with pytest.raises(pydantic.ValidationError):
        parse_event({**to_wire(TaskFinished(task_id="r1")), "surprise": 1})
    with pytest.raises(pydantic.ValidationError):
        parse_indexed_event({"idx": -1, "event": to_wire(TaskFinished(task_id="r1"))})


def test_wire_types_are_frozen():
    event = TaskFinished(task_id="r1")
    with pytest.raises(pydantic.ValidationError):
        event.task_id = "r2"


def test_submit_task_becomes_a_task_keyed_by_its_request_id():
    made = COMMANDS[3].as_task()
    assert (made.task_id, made.instance_id, made.owner_node, made.status) == (
        "r1", "i1", "a", "active")
    assert made.request == REQUEST


def test_task_id_must_match_its_request():
    with pytest.raises(pydantic.ValidationError, match="differs"):
        Task(task_id="other", instance_id="i1", owner_node="a", request=REQUEST)


# -- instance shape checks ----------------------------------------------------------------


def rank(index, world, node_id, start, end, tp_rank=0, tp_size=1):
    return Rank(runner_id=f"i.r{index}", node_id=node_id, rank=index, world_size=world,
                layer_start=start, layer_end=end, tp_rank=tp_rank, tp_size=tp_size)


def make(sharding, *ranks, n_layers=32):
    rendezvous = Rendezvous(host="127.0.0.1", port=29500) if len(ranks) > 1 else None
    return Instance(instance_id="i", request=PlacementRequest(facts=facts(n_layers=n_layers)),
                    sharding=sharding, ranks=ranks, rendezvous=rendezvous)


def test_valid_layouts_are_accepted():
    assert make("single", rank(0, 1, "a", 0, 32)).model == "tiny"
    assert make("pipeline", rank(0, 2, "a", 0, 5), rank(1, 2, "b", 5, 32)).node_ids == ("a", "b")
    tensor = make("tensor", rank(0, 2, "a", 0, 32, 0, 2), rank(1, 2, "b", 0, 32, 1, 2))
    assert tensor.rank_on("b").tp_rank == 1 and tensor.rank_on("c") is None


@pytest.mark.parametrize("sharding, ranks, message", [
    ("pipeline", (rank(0, 2, "a", 0, 10), rank(1, 2, "b", 11, 32)), "contiguous"),
    ("pipeline", (rank(0, 2, "a", 0, 10), rank(1, 2, "b", 10, 31)), "cover"),
    ("pipeline", (rank(0, 2, "a", 0, 10), rank(1, 2, "a", 10, 32)), "different node"),
    ("tensor", (rank(0, 2, "a", 0, 16, 0, 2), rank(1, 2, "b", 0, 32, 1, 2)), "all layers"),
    ("single", (rank(0, 2, "a", 0, 32), rank(1, 2, "b", 0, 32)), "one rank"),
    ("single", (rank(1, 2, "a", 0, 32),), "numbered"),
    ("single", (), "at least one"),
])
def test_inconsistent_layouts_are_refused(sharding, ranks, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        make(sharding, *ranks)


def test_rank_and_request_field_checks():
    with pytest.raises(pydantic.ValidationError, match="empty"):
        rank(0, 1, "a", 5, 5)
    with pytest.raises(pydantic.ValidationError, match="outside"):
        rank(2, 2, "a", 0, 5)
    with pytest.raises(pydantic.ValidationError, match="min_nodes"):
        PlacementRequest(facts=facts(), min_nodes=0)
    with pytest.raises(pydantic.ValidationError, match="single"):
        PlacementRequest(facts=facts(), sharding="single", min_nodes=2)
    with pytest.raises(pydantic.ValidationError, match="multiple"):
        facts(n_heads=32, n_kv_heads=6)
