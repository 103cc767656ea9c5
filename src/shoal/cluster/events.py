"""Commands (requests to the master) and events (facts the master indexed).

Both are tagged unions of frozen, strict pydantic models, discriminated by `kind`. They
travel as msgpack of model_dump(mode="json") and come back with the parse_* helpers.

  commands        api/worker -> master   PlaceInstance, DeleteInstance,
                                         RefusePlacement, SubmitTask, CancelTask
  local events    worker -> master       RunnerStatusChanged, TaskFinished, TaskFailed
  global events   master -> all          IndexedEvent(idx, event), idx contiguous from 0
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter

from shoal.cluster.instances import Frozen, Instance, PlacementRequest
from shoal.cluster.state import NodeInfo, RunnerStatus, Task
from shoal.ids import CommandId, InstanceId, NodeId, RequestId
from shoal.protocol import ErrorCode, GenerationRequest

# -- commands -----------------------------------------------------------------------------


class PlaceInstance(Frozen):
    kind: Literal["place_instance"] = "place_instance"
    command_id: CommandId
    request: PlacementRequest


class DeleteInstance(Frozen):
    kind: Literal["delete_instance"] = "delete_instance"
    command_id: CommandId
    instance_id: InstanceId
    reason: str = "deleted by request"


class RefusePlacement(Frozen):
    """A worker cannot fit its share at load time; the master re-places one node wider."""

    kind: Literal["refuse_placement"] = "refuse_placement"
    command_id: CommandId
    instance_id: InstanceId
    node_id: NodeId
    reason: str


class SubmitTask(Frozen):
    """Serve request on instance_id; the task id is the request id."""

    kind: Literal["submit_task"] = "submit_task"
    command_id: CommandId
    instance_id: InstanceId
    owner_node: NodeId
    request: GenerationRequest

    def as_task(self) -> Task:
        return Task(task_id=RequestId(self.request.request_id), instance_id=self.instance_id,
                    owner_node=self.owner_node, request=self.request)


class CancelTask(Frozen):
    """The client went away (or asked to stop); the serving node aborts the task."""

    kind: Literal["cancel_task"] = "cancel_task"
    command_id: CommandId
    task_id: RequestId


Command = Annotated[
    PlaceInstance | DeleteInstance | RefusePlacement | SubmitTask | CancelTask,
    Field(discriminator="kind"),
]

# -- events -------------------------------------------------------------------------------


class LoadFailure(Frozen):
    """A model's download or load failed on a node, and why (ClusterState.load_failures)."""

    model: str  # lower case
    node_id: NodeId
    reason: str


class SessionStarted(Frozen):
    """A new master's first event (idx 0): what survives failover, nothing else.

    Nodes, instances and the nodes where a model failed to load carry over (so a new master
    does not place a model again where it just failed); runner statuses and tasks do not
    (they belonged to the old session's plumbing). Applying it replaces the whole state.
    """

    kind: Literal["session_started"] = "session_started"
    master_id: NodeId
    nodes: tuple[NodeInfo, ...] = ()
    instances: tuple[Instance, ...] = ()
    load_failures: tuple[LoadFailure, ...] = ()


class NodeJoined(Frozen):
    kind: Literal["node_joined"] = "node_joined"
    node: NodeInfo


class NodeLeft(Frozen):
    kind: Literal["node_left"] = "node_left"
    node_id: NodeId
    # timed_out: silent past the telemetry timeout; disconnected: its presence (liveliness
    # token) was withdrawn, as when its process dies or its links drop.
    reason: Literal["timed_out", "shutdown", "disconnected"] = "timed_out"


class InstanceCreated(Frozen):
    kind: Literal["instance_created"] = "instance_created"
    instance: Instance
    command_id: CommandId | None = None  # the PlaceInstance it answers


class PlacementFailed(Frozen):
    """A PlaceInstance could not be carried out; the state does not change."""

    kind: Literal["placement_failed"] = "placement_failed"
    command_id: CommandId
    model: str
    reason: str


class InstanceDeleted(Frozen):
    kind: Literal["instance_deleted"] = "instance_deleted"
    instance_id: InstanceId
    reason: str = ""


class RunnerStatusChanged(Frozen):
    kind: Literal["runner_status_changed"] = "runner_status_changed"
    status: RunnerStatus


class TaskCreated(Frozen):
    kind: Literal["task_created"] = "task_created"
    task: Task


class TaskCancelled(Frozen):
    kind: Literal["task_cancelled"] = "task_cancelled"
    task_id: RequestId


class TaskFinished(Frozen):
    """The serving node delivered the task's last chunk (or aborted it); it leaves the state."""

    kind: Literal["task_finished"] = "task_finished"
    task_id: RequestId


class TaskFailed(Frozen):
    """The task cannot be served; its owner ends the client's stream with this error."""

    kind: Literal["task_failed"] = "task_failed"
    task_id: RequestId
    code: ErrorCode
    message: str


Event = Annotated[
    SessionStarted | NodeJoined | NodeLeft | InstanceCreated | InstanceDeleted
    | PlacementFailed | RunnerStatusChanged | TaskCreated | TaskCancelled | TaskFinished
    | TaskFailed,
    Field(discriminator="kind"),
]
# What a worker may publish on local_events for the master to index.
WorkerEvent = Annotated[
    RunnerStatusChanged | TaskFinished | TaskFailed,
    Field(discriminator="kind"),
]


class IndexedEvent(Frozen):
    idx: int = Field(ge=0)
    event: Event


_commands: TypeAdapter[Command] = TypeAdapter(Command)
_events: TypeAdapter[Event] = TypeAdapter(Event)
_worker_events: TypeAdapter[WorkerEvent] = TypeAdapter(WorkerEvent)


def to_wire(message: Frozen) -> dict[str, Any]:
    """The msgpack-ready dict of any command, event or IndexedEvent."""
    return message.model_dump(mode="json")


def parse_command(raw: Any) -> Command:
    """A command from its wire dict (pydantic.ValidationError if malformed)."""
    return _commands.validate_python(raw)


def parse_event(raw: Any) -> Event:
    return _events.validate_python(raw)


def parse_worker_event(raw: Any) -> WorkerEvent:
    return _worker_events.validate_python(raw)


def parse_indexed_event(raw: Any) -> IndexedEvent:
    return IndexedEvent.model_validate(raw)
