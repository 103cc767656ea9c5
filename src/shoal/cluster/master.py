"""The master: the cluster's only indexer, run by whichever node the election chose.

Commands (topic commands) and worker events (topic local_events) become events; each event
gets the next index, is appended to the disk event log, applied to the master's state, and
only then published on global_events. A session starts with SessionStarted (idx 0), seeded
from this node's replicated state: instances and nodes survive a failover, in-flight tasks
fail with a clear error, runner statuses are rebuilt by the workers' reports.

A periodic reconcile admits nodes that telemetry reports, and, once `settle_grace_s` has
passed since the session began (so a new master does not prune what it merely has not
heard from yet), removes nodes gone silent and re-places instances that had ranks there.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pydantic

from shoal.cluster.apply import apply
from shoal.cluster.background import cancel_and_wait
from shoal.cluster.event_log import EventLog, EventsUnavailable
from shoal.cluster.events import (
    CancelTask,
    Command,
    DeleteInstance,
    Event,
    IndexedEvent,
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
    parse_command,
    parse_worker_event,
)
from shoal.cluster.instances import Instance, PlacementRequest, Rendezvous
from shoal.cluster.node_budget import node_capacities
from shoal.cluster.placement import (
    DEFAULT_POLICY,
    NodeCapacity,
    Placement,
    PlacementPolicy,
    place,
    widen,
)
from shoal.cluster.state import ClusterState, NodeInfo, Task
from shoal.cluster.sync import (
    SessionEvent,
    SyncRequest,
    SyncResponse,
    parse_sync_message,
)
from shoal.cluster.telemetry import TelemetryTable
from shoal.cluster.transport.base import Subscription, Transport
from shoal.cluster.transport.topics import Topic
from shoal.ids import CommandId, InstanceId, NodeId, new_instance_id

log = logging.getLogger("shoal.cluster.master")


@dataclass(frozen=True)
class MasterConfig:
    # After a session starts, no node is declared gone and no instance pruned for this long.
    settle_grace_s: float = 30.0
    reconcile_s: float = 1.0
    # A state-sync answer is the latest snapshot plus at most this many logged events.
    snapshot_every: int = 256
    policy: PlacementPolicy = DEFAULT_POLICY
    # A placed instance whose runner fails is placed again, at most this many times.
    max_replacements: int = 3
    # Rendezvous ports of multi-rank instances are drawn from [low, high): below Linux's
    # ephemeral range (32768-60999), where outgoing connections would collide with them.
    rendezvous_ports: tuple[int, int] = (29500, 32768)

    def __post_init__(self) -> None:
        if self.settle_grace_s < 0 or self.reconcile_s <= 0:
            raise ValueError("master settle_grace_s must be >= 0 and reconcile_s positive")
        if self.snapshot_every < 1:
            raise ValueError("master snapshot_every must be >= 1")
        if self.max_replacements < 0:
            raise ValueError("master max_replacements must be >= 0")
        low, high = self.rendezvous_ports
        if not 0 < low < high <= 65536:
            raise ValueError(f"invalid rendezvous port range {low}-{high}")


class Master:
    """Indexes one session's events; start() begins the session, stop() ends it."""

    def __init__(self, transport: Transport, telemetry: TelemetryTable, event_log: EventLog,
                 config: MasterConfig | None = None, seed: ClusterState | None = None) -> None:
        self._transport = transport
        self._telemetry = telemetry
        self._log = event_log
        self.config = config or MasterConfig()
        self._seed = seed or ClusterState()
        self.node_id = transport.node_id
        self.session = uuid.uuid4().hex
        self.state = ClusterState()
        self._snapshot = ClusterState()  # sync answers start from here
        self._started_at: float | None = None
        self._subscriptions: list[Subscription] = []
        self._reconciler: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._started_at = time.monotonic()
        self._begin_session()
        self._subscriptions = [
            self._transport.subscribe(Topic.COMMANDS, self._on_command),
            self._transport.subscribe(Topic.LOCAL_EVENTS, self._on_worker_event),
            self._transport.subscribe(Topic.STATE_SYNC, self._on_sync)]
        self._reconciler = asyncio.create_task(self._reconcile_loop(), name="master-reconcile")
        log.info("node %s is master: session %s, %d instance(s) carried over", self.node_id,
                 self.session[:8], len(self.state.instances))

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            subscription.close()
        self._subscriptions = []
        await cancel_and_wait([self._reconciler])
        self._reconciler = None
        self._log.close()

    # --- indexing ----------------------------------------------------------------------------

    def _index(self, event: Event) -> IndexedEvent:
        """Give event the next index, persist it, apply it, then publish it."""
        indexed = IndexedEvent(idx=self.state.next_event_idx(), event=event)
        self._log.append(indexed)
        self.state = apply(self.state, indexed)
        self._transport.publish(Topic.GLOBAL_EVENTS, SessionEvent(
            session=self.session, master=self.node_id, indexed=indexed).model_dump(mode="json"))
        if indexed.idx - self._snapshot.next_event_idx() + 1 >= self.config.snapshot_every:
            self._snapshot = self.state
        return indexed

    def _begin_session(self) -> None:
        seed = self._seed
        self._index(SessionStarted(master_id=self.node_id, nodes=tuple(seed.nodes.values()),
                                   instances=tuple(seed.instances.values())))
        for task in seed.tasks.values():
            # Their streams ran through the previous session's plumbing, which is gone.
            self._index(TaskFailed(task_id=task.task_id, code="unavailable",
                                   message=f"the cluster master changed (now {self.node_id}) "
                                           "while this request was in flight; retry it"))

    # --- commands and worker events ----------------------------------------------------------

    def handle_command(self, command: Command) -> list[IndexedEvent]:
        """The events command becomes (none when it is moot or cannot be carried out)."""
        if isinstance(command, PlaceInstance):
            return self._place(command.request, why=f"command {command.command_id}",
                               command_id=command.command_id)
        if isinstance(command, DeleteInstance):
            return self._delete_instance(command.instance_id, command.reason)
        if isinstance(command, RefusePlacement):
            return self._replace_refused(command)
        if isinstance(command, SubmitTask):
            return self._submit(command)
        if isinstance(command, CancelTask):
            task = self.state.tasks.get(command.task_id)
            if task is None or task.status == "cancelled":
                return []
            return [self._index(TaskCancelled(task_id=command.task_id))]
        raise TypeError(f"unknown command {type(command).__name__}")

    def _on_command(self, message: Any) -> None:
        try:
            command = parse_command(message)
        except pydantic.ValidationError as error:
            log.warning("malformed command dropped: %s", error)
            return
        self.handle_command(command)

    def _on_worker_event(self, message: Any) -> None:
        try:
            event = parse_worker_event(message)
        except pydantic.ValidationError as error:
            log.warning("malformed worker event dropped: %s", error)
            return
        self.handle_worker_event(event)

    def handle_worker_event(self, event: Any) -> list[IndexedEvent]:
        """Index a worker's report; a placed instance whose runner failed is placed again."""
        events = [self._index(event)]
        if isinstance(event, RunnerStatusChanged) and event.status.phase == "failed":
            instance = self.state.instances.get(event.status.instance_id)
            if instance is not None:
                events += self._replace_failed(instance, event.status.node_id,
                                               event.status.message)
        return events

    def _submit(self, command: SubmitTask) -> list[IndexedEvent]:
        task_id = command.request.request_id
        if task_id in self.state.tasks:
            return []  # a repeated command: the task already exists
        if command.instance_id not in self.state.instances:
            return [self._index(TaskFailed(
                task_id=task_id, code="unavailable",
                message=f"instance {command.instance_id} does not exist (deleted or never "
                        "placed)"))]
        task = Task(task_id=task_id, instance_id=command.instance_id,
                    owner_node=command.owner_node, request=command.request)
        return [self._index(TaskCreated(task=task))]

    def _place(self, request: PlacementRequest, why: str,
               command_id: CommandId | None = None, attempt: int = 0) -> list[IndexedEvent]:
        result = place(request, self._capacities(), self.config.policy)
        if not isinstance(result, Placement):
            log.warning("cannot place model %s (%s): %s", request.model, why, result.reason)
            if command_id is None:
                return []
            return [self._index(PlacementFailed(command_id=command_id, model=request.model,
                                                reason=result.reason))]
        instance = result.to_instance(new_instance_id(), self._rendezvous_for(result), attempt)
        log.info("placing %s as %s over %s (%s)", request.model, instance.instance_id,
                 ", ".join(instance.node_ids), why)
        return [self._index(InstanceCreated(instance=instance, command_id=command_id))]

    def _rendezvous_for(self, placement: Placement) -> Rendezvous | None:
        """Rank 0's node address and a fresh port, for an instance of several ranks."""
        if placement.width == 1:
            return None
        node = self.state.nodes.get(placement.shards[0].node_id)
        host = rendezvous_host(node.addresses if node is not None else ())
        low, high = self.config.rendezvous_ports
        return Rendezvous(host=host, port=random.randrange(low, high))

    def _replace_failed(self, instance: Instance, node_id: NodeId,
                        message: str) -> list[IndexedEvent]:
        reason = f"its runner on node {node_id} failed: {message or 'no reason given'}"
        events = self._delete_instance(instance.instance_id, reason)
        if instance.request.on_demand:
            return events  # the next request for the model places it anew
        attempt = instance.attempt + 1
        if attempt > self.config.max_replacements:
            log.warning("instance %s of %s failed; not placing it again after %d attempts",
                        instance.instance_id, instance.model, attempt)
            return events
        return events + self._place(instance.request, attempt=attempt,
                                    why=f"{instance.instance_id} failed (attempt {attempt})")

    def _delete_instance(self, instance_id: InstanceId, reason: str) -> list[IndexedEvent]:
        instance = self.state.instances.get(instance_id)
        if instance is None:
            return []
        events = [self._index(TaskFailed(task_id=task.task_id, code="unavailable",
                                         message=f"model {instance.model!r} was unloaded: "
                                                 f"{reason}"))
                  for task in self.state.tasks_of(instance_id)]
        return events + [self._index(InstanceDeleted(instance_id=instance_id, reason=reason))]

    def _replace_refused(self, command: RefusePlacement) -> list[IndexedEvent]:
        instance = self.state.instances.get(command.instance_id)
        if instance is None or command.node_id not in instance.node_ids:
            return []  # already handled: refusals are idempotent
        events = self._delete_instance(
            instance.instance_id, f"node {command.node_id} cannot fit its share: "
                                  f"{command.reason}")
        wider = widen(instance.request, len(instance.ranks), len(self._capacities()))
        if wider is None:
            log.warning("model %s refused at width %d and cannot go wider", instance.model,
                        len(instance.ranks))
            return events
        return events + self._place(wider, why=f"re-placed one node wider than "
                                               f"{instance.instance_id}")

    # --- reconcile: membership and dead instances -------------------------------------------

    def reconcile(self, now: float | None = None) -> list[IndexedEvent]:
        """Admit reporting nodes; after the settle grace, prune the silent and re-place."""
        now = time.monotonic() if now is None else now
        events = self._admit_nodes(now)
        if self._started_at is None or now - self._started_at < self.config.settle_grace_s:
            return events
        for node_id in list(self.state.nodes):
            if not self._telemetry.is_alive(node_id, now):
                log.warning("node %s silent for over %gs: removing it", node_id,
                            self._telemetry.timeout_s)
                events.append(self._index(NodeLeft(node_id=node_id, reason="timed_out")))
        for instance in list(self.state.instances.values()):
            gone = [n for n in instance.node_ids if n not in self.state.nodes]
            if gone:
                events += self._replace_lost(instance, gone)
        return events

    def _admit_nodes(self, now: float) -> list[IndexedEvent]:
        events = []
        for node_id in sorted(self._telemetry.live_nodes(now)):
            reading = self._telemetry.reading(node_id)
            if reading is None:
                continue
            info = NodeInfo(node_id=node_id, name=reading.name or node_id,
                            addresses=reading.addresses)
            if self.state.nodes.get(node_id) != info:
                events.append(self._index(NodeJoined(node=info)))
        return events

    def _replace_lost(self, instance: Instance, gone: Sequence[NodeId]) -> list[IndexedEvent]:
        reason = f"node {', '.join(gone)} left the cluster"
        events = self._delete_instance(instance.instance_id, reason)
        if instance.request.on_demand:
            return events  # placed for requests: the next one places it anew
        return events + self._place(instance.request, attempt=instance.attempt,
                                    why=f"{instance.instance_id} lost {reason}")

    def _capacities(self) -> list[NodeCapacity]:
        readings = self._telemetry.live_readings(list(self.state.nodes), time.monotonic())
        return node_capacities(readings, self.state, self.config.policy)

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.reconcile_s)
            try:
                self.reconcile()
            except Exception:  # keep the master alive; the next pass retries
                log.exception("master reconcile failed")

    # --- state sync ----------------------------------------------------------------------------

    def sync_response(self, node: NodeId) -> SyncResponse:
        """The latest snapshot and the logged events after it (or the whole current state
        when the log cannot provide them)."""
        snapshot, tail = self._snapshot, ()
        if snapshot.last_event_idx != self.state.last_event_idx:
            try:
                tail = tuple(self._log.read(snapshot.next_event_idx()))
            except (EventsUnavailable, OSError, ValueError) as error:
                log.warning("answering a state sync from memory: %s", error)
                snapshot, tail = self.state, ()
        return SyncResponse(to=node, session=self.session, master=self.node_id,
                            snapshot=snapshot, tail=tail)

    def _on_sync(self, message: Any) -> None:
        try:
            request = parse_sync_message(message)
        except pydantic.ValidationError as error:
            log.warning("malformed state-sync message dropped: %s", error)
            return
        if isinstance(request, SyncRequest):
            self._transport.publish(Topic.STATE_SYNC,
                                    self.sync_response(request.node).model_dump(mode="json"))


def rendezvous_host(addresses: Sequence[str]) -> str:
    """The host part of a node's first reachable address ("host:port" or "[v6]:port")."""
    for address in addresses:
        host = address.rsplit(":", 1)[0].strip("[]")
        if host and host not in ("0.0.0.0", "::"):
            return host
    log.warning("node reports no reachable address; rendezvous falls back to 127.0.0.1")
    return "127.0.0.1"
