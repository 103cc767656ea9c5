"""The master's decisions as pure functions: (state, input, facts) -> Decision.

Nothing here reads a clock, the network or a random source: the driver (master.py) reads
the telemetry and draws a seed into Facts, indexes the events a decision returns in order,
and logs its notes. The same inputs always give the same events, so a decision can be
tested, replayed and explained from its inputs alone.

Placement is a target. A decision says which instances stay and which placement requests
are wanted; `plan` places the wanted ones against the memory the kept ones leave, and
`converge` turns the difference between that target and the state into events: deletions
(failing their tasks) first, then creations.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from shoal.cluster.apply import apply
from shoal.cluster.events import (
    CancelTask,
    Command,
    DeleteInstance,
    Event,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    LoadFailure,
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
from shoal.cluster.instances import Instance, PlacementRequest, Rendezvous
from shoal.cluster.node_budget import node_capacities
from shoal.cluster.placement import (
    NodeCapacity,
    Placement,
    PlacementError,
    PlacementPolicy,
    place,
    widen,
)
from shoal.cluster.state import ClusterState, NodeInfo, Task
from shoal.cluster.telemetry import NodeReading
from shoal.ids import CommandId, InstanceId, NodeId


@dataclass(frozen=True)
class Facts:
    """What a decision may know besides the state, read once by the driver."""

    # The latest reading of every node heard from within the telemetry timeout.
    readings: Mapping[NodeId, NodeReading]
    policy: PlacementPolicy
    # A placed instance whose runner fails is placed again at most this many times.
    max_replacements: int
    # Rendezvous ports of multi-rank instances are drawn from [low, high).
    rendezvous_ports: tuple[int, int]
    # New instance ids and rendezvous ports are drawn from this seed.
    seed: int = 0
    # False during a new master's settle grace: no node is declared gone for silence yet.
    settled: bool = True
    # Member nodes whose presence (Zenoh liveliness token) is gone: they leave at once,
    # settled or not, and their last readings no longer count.
    departed: frozenset[NodeId] = frozenset()


@dataclass
class Decision:
    """Events to index in order, and (logging level, message) notes for the driver's log."""

    events: list[Event] = field(default_factory=list)
    notes: list[tuple[int, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Want:
    """A placement a decision asks for: the request, its attempt number, and why."""

    request: PlacementRequest
    why: str
    attempt: int = 0


@dataclass(frozen=True)
class Target:
    """The instances the cluster should have; `failed`: wanted placements that fit nowhere,
    with the reason."""

    instances: Mapping[InstanceId, Instance]
    failed: tuple[tuple[Want, str], ...] = ()


class _Draft:
    """A decision being made: events are folded into a scratch state as they are added, so
    later steps see earlier ones (a re-placement sees the memory its predecessor freed)."""

    def __init__(self, state: ClusterState, facts: Facts) -> None:
        self.state = state
        self.facts = facts
        self.decision = Decision()
        self.random = random.Random(facts.seed)

    def add(self, event: Event) -> None:
        self.state = apply(self.state, IndexedEvent(idx=self.state.next_event_idx(),
                                                    event=event))
        self.decision.events.append(event)

    def note(self, level: int, message: str) -> None:
        self.decision.notes.append((level, message))


# --- placement as a target ---------------------------------------------------------------------


def capacities(state: ClusterState, facts: Facts) -> list[NodeCapacity]:
    """What each member node that is reporting can still take, given state's instances."""
    readings = [facts.readings[n] for n in state.nodes if n in facts.readings]
    return node_capacities(readings, state, facts.policy)


def plan(state: ClusterState, keep: Iterable[InstanceId], wanted: Sequence[Want],
         facts: Facts, rng: random.Random) -> Target:
    """Keep these instances and place the wanted requests, each against the memory that the
    kept instances and the earlier wanted ones leave."""
    kept = {i: state.instances[i] for i in keep if i in state.instances}
    planned = state.model_copy(update={"instances": kept})
    failed = []
    for want in wanted:
        result = place_avoiding_failures(state, want.request, capacities(planned, facts),
                                         facts.policy)
        if not isinstance(result, Placement):
            failed.append((want, result.reason))
            continue
        instance_id = InstanceId(f"inst-{rng.getrandbits(64):016x}")
        instance = result.to_instance(instance_id, _rendezvous(state, result, facts, rng),
                                      want.attempt)
        planned = planned.model_copy(
            update={"instances": {**planned.instances, instance_id: instance}})
    return Target(instances=planned.instances, failed=tuple(failed))


def place_avoiding_failures(state: ClusterState, request: PlacementRequest,
                            nodes: Sequence[NodeCapacity], policy: PlacementPolicy
                            ) -> Placement | PlacementError:
    """place(), leaving out the nodes where the model's download or load failed; only when
    it fits nowhere else are they tried again (each failure is bounded by the caller's
    replacement count), and a refusal then names them and why."""
    failed = state.failed_nodes(request.model)
    avoid = tuple(n for n in sorted(failed) if n not in request.excluded_nodes)
    if not avoid:
        return place(request, nodes, policy)
    elsewhere = place(request.model_copy(
        update={"excluded_nodes": (*request.excluded_nodes, *avoid)}), nodes, policy)
    if isinstance(elsewhere, Placement):
        return elsewhere
    again = place(request, nodes, policy)
    if isinstance(again, Placement):
        return again
    note = "; ".join(f"node {node}: {failed[node]}" for node in avoid)
    return PlacementError(f"{again.reason} (it failed before on {note})", again.pending)


def _rendezvous(state: ClusterState, placement: Placement, facts: Facts,
                rng: random.Random) -> Rendezvous | None:
    """Rank 0's node address and a fresh port, for an instance of several ranks."""
    if placement.width == 1:
        return None
    node = state.nodes.get(placement.shards[0].node_id)
    low, high = facts.rendezvous_ports
    return Rendezvous(host=rendezvous_host(node.addresses if node is not None else ()),
                      port=rng.randrange(low, high))


def rendezvous_host(addresses: Sequence[str]) -> str:
    """The host part of a node's first reachable address ("host:port" or "[v6]:port");
    127.0.0.1 when it reports none."""
    for address in addresses:
        host = address.rsplit(":", 1)[0].strip("[]")
        if host and host not in ("0.0.0.0", "::"):
            return host
    return "127.0.0.1"


def _converge(draft: _Draft, target: Target, reasons: Mapping[InstanceId, str],
              command_id: CommandId | None = None) -> None:
    """Events that take the draft's state to target: deletions (their tasks failed, with
    the reason), then creations."""
    for instance_id in list(draft.state.instances):
        if instance_id not in target.instances:
            _delete(draft, instance_id, reasons.get(instance_id, "no longer wanted"))
    for instance_id, instance in target.instances.items():
        if instance_id not in draft.state.instances:
            draft.note(logging.INFO, f"placing {instance.model} as {instance_id} over "
                                     f"{', '.join(instance.node_ids)}")
            draft.add(InstanceCreated(instance=instance, command_id=command_id))
    for want, reason in target.failed:
        draft.note(logging.WARNING, f"cannot place model {want.request.model} ({want.why}): "
                                    f"{reason}")


def _delete(draft: _Draft, instance_id: InstanceId, reason: str) -> None:
    instance = draft.state.instances[instance_id]
    for task in draft.state.tasks_of(instance_id):
        draft.add(TaskFailed(task_id=task.task_id, code="unavailable",
                             message=f"model {instance.model!r} was unloaded: {reason}"))
    draft.add(InstanceDeleted(instance_id=instance_id, reason=reason))


def _replace(draft: _Draft, gone: Mapping[InstanceId, str], wanted: Sequence[Want],
             command_id: CommandId | None = None) -> None:
    """Drop the instances in gone (id -> reason) and place the wanted requests."""
    keep = [i for i in draft.state.instances if i not in gone]
    _converge(draft, plan(draft.state, keep, wanted, draft.facts, draft.random), gone,
              command_id)


# --- decisions ----------------------------------------------------------------------------------


def begin_session(seed: ClusterState, master_id: NodeId) -> list[Event]:
    """A new session's first events: the carried-over nodes, instances and load failures, and
    a failure for each task that was in flight (its stream ran through the previous
    session's plumbing)."""
    failures = tuple(LoadFailure(model=model, node_id=node, reason=reason)
                     for model, failed in sorted(seed.load_failures.items())
                     for node, reason in sorted(failed.items()))
    events: list[Event] = [SessionStarted(master_id=master_id, nodes=tuple(seed.nodes.values()),
                                          instances=tuple(seed.instances.values()),
                                          load_failures=failures)]
    events += [TaskFailed(task_id=task.task_id, code="unavailable",
                          message=f"the cluster master changed (now {master_id}) while this "
                                  "request was in flight; retry it")
               for task in seed.tasks.values()]
    return events


def on_command(state: ClusterState, command: Command, facts: Facts) -> Decision:
    """The events a command becomes (none when it is moot or cannot be carried out)."""
    draft = _Draft(state, facts)
    if isinstance(command, PlaceInstance):
        _place_for_command(draft, command)
    elif isinstance(command, DeleteInstance):
        if command.instance_id in state.instances:
            _replace(draft, {command.instance_id: command.reason}, ())
    elif isinstance(command, RefusePlacement):
        _replace_refused(draft, command)
    elif isinstance(command, SubmitTask):
        event = _submit(state, command)
        if event is not None:
            draft.add(event)
    elif isinstance(command, CancelTask):
        task = state.tasks.get(command.task_id)
        if task is not None and task.status != "cancelled":
            draft.add(TaskCancelled(task_id=command.task_id))
    else:
        raise TypeError(f"unknown command {type(command).__name__}")
    return draft.decision


def _place_for_command(draft: _Draft, command: PlaceInstance) -> None:
    want = Want(command.request, why=f"command {command.command_id}")
    target = plan(draft.state, draft.state.instances, [want], draft.facts, draft.random)
    _converge(draft, target, {}, command.command_id)
    for _, reason in target.failed:
        draft.add(PlacementFailed(command_id=command.command_id, model=command.request.model,
                                  reason=reason))


def _submit(state: ClusterState, command: SubmitTask) -> Event | None:
    task_id = command.request.request_id
    if task_id in state.tasks:
        return None  # a repeated command: the task already exists
    if command.instance_id not in state.instances:
        return TaskFailed(task_id=task_id, code="unavailable",
                          message=f"instance {command.instance_id} does not exist (deleted or "
                                  "never placed)")
    return TaskCreated(task=Task(task_id=task_id, instance_id=command.instance_id,
                                 owner_node=command.owner_node, request=command.request))


def _replace_refused(draft: _Draft, command: RefusePlacement) -> None:
    instance = draft.state.instances.get(command.instance_id)
    if instance is None or command.node_id not in instance.node_ids:
        return  # already handled: refusals are idempotent
    reason = f"node {command.node_id} cannot fit its share: {command.reason}"
    reporting = sum(1 for n in draft.state.nodes if n in draft.facts.readings)
    wider = widen(instance.request, len(instance.ranks), reporting)
    if wider is None:
        draft.note(logging.WARNING, f"model {instance.model} refused at width "
                                    f"{len(instance.ranks)} and cannot go wider")
    wanted = [] if wider is None else [
        Want(wider, why=f"re-placed one node wider than {instance.instance_id}")]
    _replace(draft, {instance.instance_id: reason}, wanted)


def on_worker_event(state: ClusterState, event: Event, facts: Facts) -> Decision:
    """A worker's report, indexed as it is; an instance whose runner failed is deleted and,
    unless it was placed for requests, placed again (a bounded number of times)."""
    draft = _Draft(state, facts)
    draft.add(event)
    if not (isinstance(event, RunnerStatusChanged) and event.status.phase == "failed"):
        return draft.decision
    instance = draft.state.instances.get(event.status.instance_id)
    if instance is None:
        return draft.decision
    reason = (f"its runner on node {event.status.node_id} failed: "
              f"{event.status.message or 'no reason given'}")
    attempt = instance.attempt + 1
    wanted = []  # placed for requests (on_demand): the next request places it anew
    if not instance.request.on_demand and attempt > facts.max_replacements:
        draft.note(logging.WARNING, f"instance {instance.instance_id} of {instance.model} "
                                    f"failed; not placing it again after {attempt} attempts")
    elif not instance.request.on_demand:
        wanted = [Want(instance.request, attempt=attempt,
                       why=f"{instance.instance_id} failed (attempt {attempt})")]
    _replace(draft, {instance.instance_id: reason}, wanted)
    return draft.decision


def reconcile(state: ClusterState, facts: Facts) -> Decision:
    """Admit reporting nodes (or record their new name and addresses); remove departed
    nodes, and once settled the silent ones too; re-place the instances that had ranks there
    (those placed for requests are only deleted: the next request places them anew)."""
    draft = _Draft(state, facts)
    for node_id in sorted(set(facts.readings) - facts.departed):
        reading = facts.readings[node_id]
        info = NodeInfo(node_id=node_id, name=reading.name or node_id,
                        addresses=reading.addresses)
        if state.nodes.get(node_id) != info:
            draft.add(NodeJoined(node=info))
    for node_id in list(draft.state.nodes):
        if node_id in facts.departed:
            draft.note(logging.WARNING, f"node {node_id} disconnected: removing it")
            draft.add(NodeLeft(node_id=node_id, reason="disconnected"))
        elif facts.settled and node_id not in facts.readings:
            draft.note(logging.WARNING, f"node {node_id} went silent: removing it")
            draft.add(NodeLeft(node_id=node_id, reason="timed_out"))
    gone: dict[InstanceId, str] = {}
    wanted = []
    for instance in draft.state.instances.values():
        lost = [n for n in instance.node_ids if n not in draft.state.nodes]
        if not lost:
            continue
        gone[instance.instance_id] = f"node {', '.join(lost)} left the cluster"
        if not instance.request.on_demand:
            wanted.append(Want(instance.request, attempt=instance.attempt,
                               why=f"{instance.instance_id} lost: {gone[instance.instance_id]}"))
    if gone:
        _replace(draft, gone, wanted)
    return draft.decision
