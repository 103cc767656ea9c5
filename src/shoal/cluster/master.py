"""The master: the cluster's only indexer, run by whichever node the election chose.

Commands (topic commands) and worker events (topic local_events) become events; each event
gets the next index, is appended to the disk event log, applied to the master's state, and
only then published on global_events. A session starts with SessionStarted (idx 0), seeded
from this node's replicated state: instances and nodes survive a failover, in-flight tasks
fail with a clear error, runner statuses are rebuilt by the workers' reports.

What each command, worker event and periodic reconcile becomes is decided by the pure
functions of decide.py; this driver reads the telemetry and the clock into their Facts,
indexes the events they return and logs their notes. A periodic reconcile admits nodes that
telemetry reports, and, once `settle_grace_s` has passed since the session began (so a new
master does not prune what it merely has not heard from yet), removes nodes gone silent and
re-places instances that had ranks there.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import pydantic

from shoal.cluster import decide
from shoal.cluster.apply import apply
from shoal.cluster.background import cancel_and_wait
from shoal.cluster.decide import Decision, Facts
from shoal.cluster.event_log import EventLog, EventsUnavailable
from shoal.cluster.events import (
    Command,
    Event,
    IndexedEvent,
    NodeLeft,
    parse_command,
    parse_worker_event,
)
from shoal.cluster.placement import DEFAULT_POLICY, PlacementPolicy
from shoal.cluster.quorum import describe_quorum, holds_quorum
from shoal.cluster.state import ClusterState
from shoal.cluster.sync import SessionEvent, SyncRequest, SyncResponse, parse_sync_message
from shoal.cluster.telemetry import TelemetryTable
from shoal.cluster.transport.base import Subscription, Transport
from shoal.cluster.transport.topics import Topic
from shoal.ids import NodeId

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
                 config: MasterConfig | None = None, seed: ClusterState | None = None,
                 reachable: Callable[[], frozenset[NodeId]] | None = None) -> None:
        """reachable: the nodes this one hears now, itself included (default: the
        transport's peers); a quorum of the state's nodes among them lets it index."""
        self._transport = transport
        self._reachable = reachable or (lambda: self._transport.peers | {self.node_id})
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
            self._transport.subscribe(Topic.STATE_SYNC, self._on_sync),
            # A node whose presence goes is removed now, not at the next reconcile tick.
            self._transport.on_peers_changed(self._on_peers_changed)]
        self._reconciler = asyncio.create_task(self._reconcile_loop(), name="master-reconcile")
        log.info("node %s is master: session %s, %d instance(s) carried over", self.node_id,
                 self.session[:8], len(self.state.instances))

    def leave(self) -> IndexedEvent | None:
        """Index this node's own departure as it shuts down, while it holds a quorum and
        others remain: the rest then hold a quorum of their own (a two-node cluster's other
        node becomes master) instead of waiting for this node to come back."""
        if set(self.state.nodes) <= {self.node_id} or not self.holds_quorum():
            return None
        log.info("master %s leaves the cluster: it shuts down", self.node_id)
        return self._index(NodeLeft(node_id=self.node_id, reason="shutdown"))

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
        for event in decide.begin_session(self._seed, self.node_id):
            self._index(event)

    # --- commands, worker events and reconcile: decided in decide.py, carried out here ----

    def _facts(self, now: float | None = None) -> Facts:
        now = time.monotonic() if now is None else now
        readings = {node_id: reading for node_id in self._telemetry.live_nodes(now)
                    if (reading := self._telemetry.reading(node_id)) is not None}
        settled = (self._started_at is not None
                   and now - self._started_at >= self.config.settle_grace_s)
        present = self._transport.peers | {self.node_id}
        departed = frozenset(n for n in set(self.state.nodes) | set(readings)
                             if n not in present)
        return Facts(readings=readings, policy=self.config.policy,
                     max_replacements=self.config.max_replacements,
                     rendezvous_ports=self.config.rendezvous_ports,
                     seed=random.getrandbits(64), settled=settled, departed=departed)

    def holds_quorum(self) -> bool:
        """Whether this master sees a quorum of the state's nodes (quorum.py): it indexes
        nothing without one."""
        return holds_quorum(self.state.nodes, self._reachable(), self.state.session_master)

    def _carry_out(self, decision: Decision) -> list[IndexedEvent]:
        if decision.events and not self.holds_quorum():
            # Cut off from most of the cluster: whatever this side decides, the other side
            # may decide otherwise. The control plane steps this master down.
            log.warning("master %s indexes nothing: %s", self.node_id,
                        describe_quorum(self.state.nodes, self._reachable()))
            return []
        for level, message in decision.notes:
            log.log(level, message)
        return [self._index(event) for event in decision.events]

    def handle_command(self, command: Command) -> list[IndexedEvent]:
        """The events command becomes (none when it is moot or cannot be carried out)."""
        return self._carry_out(decide.on_command(self.state, command, self._facts()))

    def handle_worker_event(self, event: Any) -> list[IndexedEvent]:
        """Index a worker's report; a placed instance whose runner failed is placed again."""
        return self._carry_out(decide.on_worker_event(self.state, event, self._facts()))

    def reconcile(self, now: float | None = None) -> list[IndexedEvent]:
        """Admit reporting nodes; after the settle grace, prune the silent and re-place."""
        return self._carry_out(decide.reconcile(self.state, self._facts(now)))

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

    def _on_peers_changed(self, _peers: Any) -> None:
        try:
            self.reconcile()
        except Exception:  # keep the master alive; the next tick retries
            log.exception("master reconcile on a presence change failed")

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

