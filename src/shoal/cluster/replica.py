"""The follower side: every node's replicated ClusterState, built from the master's events.

Events are applied strictly in index order. One that arrives early is buffered; a gap, an
unknown session or a late start makes the replica ask the master for a snapshot and the log
tail (topic state_sync), at most once per `sync_timeout_s` and again until answered. A new
session's event 0 (SessionStarted) starts it afresh without asking.

`follow(master)` tells the replica which master the election chose, so a deposed master's
last words cannot pull it back to an old session.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic

from shoal.cluster.apply import apply, apply_all
from shoal.cluster.background import cancel_and_wait
from shoal.cluster.events import IndexedEvent, SessionStarted
from shoal.cluster.state import ClusterState
from shoal.cluster.sync import (
    SessionEvent,
    SyncRequest,
    SyncResponse,
    parse_sync_message,
)
from shoal.cluster.transport.base import Fanout, Subscription, Transport
from shoal.cluster.transport.topics import Topic
from shoal.ids import NodeId

log = logging.getLogger("shoal.cluster.replica")

_EVENT = "event"
_RESET = "reset"


@dataclass(frozen=True)
class ReplicaConfig:
    sync_timeout_s: float = 2.0
    # Early events held while a gap is being filled; past this the buffer is dropped and the
    # replica relies on the sync answer alone.
    max_buffered: int = 10_000

    def __post_init__(self) -> None:
        if self.sync_timeout_s <= 0 or self.max_buffered < 1:
            raise ValueError("replica sync_timeout_s must be positive and max_buffered >= 1")


class Replica:
    """This node's copy of the cluster state; start() subscribes, stop() unsubscribes."""

    def __init__(self, transport: Transport, config: ReplicaConfig | None = None) -> None:
        self._transport = transport
        self.config = config or ReplicaConfig()
        self.node_id = transport.node_id
        self.state = ClusterState()
        self.session: str | None = None
        self.master: NodeId | None = None  # the master of the session being replicated
        self.sessions_followed = 0  # masters' sessions this node followed (GET /metrics)
        self.events_applied = 0
        self._following: NodeId | None = None
        self._pending_session: str | None = None  # the session the buffer belongs to
        self._buffer: dict[int, IndexedEvent] = {}
        self._sync_sent_at: float | None = None
        self._callbacks = Fanout()
        self._subscriptions: list[Subscription] = []
        self._ticker: asyncio.Task[None] | None = None

    def on_event(self, callback: Callable[[IndexedEvent], None]) -> Subscription:
        """callback(indexed) after each event is applied (self.state already includes it)."""
        return self._callbacks.add(_EVENT, callback)

    def on_reset(self, callback: Callable[[ClusterState], None]) -> Subscription:
        """callback(state) when a sync snapshot replaces the state wholesale."""
        return self._callbacks.add(_RESET, callback)

    def follow(self, master: NodeId | None) -> None:
        """Replicate only sessions of master (None: any); resync if we follow another."""
        self._following = master
        if master is not None and master != self.master:
            self._request_sync(force=True)

    @property
    def in_sync(self) -> bool:
        return self.session is not None and not self._buffer

    async def start(self) -> None:
        self._subscriptions = [
            self._transport.subscribe(Topic.GLOBAL_EVENTS, self._on_global_event),
            self._transport.subscribe(Topic.STATE_SYNC, self._on_sync)]
        self._ticker = asyncio.create_task(self._tick(), name="replica-sync")
        self._request_sync(force=True)

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            subscription.close()
        self._subscriptions = []
        await cancel_and_wait([self._ticker])
        self._ticker = None

    # --- global events -------------------------------------------------------------------------

    def _on_global_event(self, message: Any) -> None:
        try:
            message = SessionEvent.model_validate(message)
        except pydantic.ValidationError as error:
            log.warning("malformed global event dropped: %s", error)
            return
        if self._following is not None and message.master != self._following:
            return  # a master the election no longer recognises
        indexed = message.indexed
        if message.session != self.session:
            if indexed.idx == 0 and isinstance(indexed.event, SessionStarted):
                log.info("node %s follows session %s of master %s", self.node_id,
                         message.session[:8], message.master)
                self._start_session(message.session, message.master, ClusterState())
            else:
                self._hold(message.session, indexed)
                return
        next_idx = self.state.next_event_idx()
        if indexed.idx < next_idx:
            return  # a repeat, already applied (from a snapshot's tail, say)
        if indexed.idx > next_idx:
            self._hold(message.session, indexed)
            return
        self._apply(indexed)
        self._drain()

    def _start_session(self, session: str, master: NodeId, state: ClusterState) -> None:
        if session != self.session:
            self.sessions_followed += 1
        self.session, self.master, self.state = session, master, state
        if self._pending_session != session:
            self._buffer.clear()
        self._pending_session = session

    def _apply(self, indexed: IndexedEvent) -> None:
        self.state = apply(self.state, indexed)
        self.events_applied += 1
        self._callbacks.deliver(_EVENT, indexed)

    def _drain(self) -> None:
        while (indexed := self._buffer.pop(self.state.next_event_idx(), None)) is not None:
            self._apply(indexed)
        stale = [idx for idx in self._buffer if idx < self.state.next_event_idx()]
        for idx in stale:
            del self._buffer[idx]
        if not self._buffer:
            self._sync_sent_at = None

    def _hold(self, session: str, indexed: IndexedEvent) -> None:
        """Buffer an event that cannot be applied yet, and ask for what is missing."""
        if self._pending_session != session:
            self._pending_session = session
            self._buffer.clear()
        if len(self._buffer) >= self.config.max_buffered:
            log.warning("node %s: %d events buffered behind a gap; dropping them and waiting "
                        "for a state sync", self.node_id, len(self._buffer))
            self._buffer.clear()
        self._buffer[indexed.idx] = indexed
        self._request_sync()

    # --- state sync ----------------------------------------------------------------------------

    def _request_sync(self, force: bool = False) -> None:
        now = time.monotonic()
        if (not force and self._sync_sent_at is not None
                and now - self._sync_sent_at < self.config.sync_timeout_s):
            return  # one request in flight at a time
        self._sync_sent_at = now
        self._transport.publish(Topic.STATE_SYNC, SyncRequest(node=self.node_id)
                                .model_dump(mode="json"))

    def _on_sync(self, message: Any) -> None:
        if not isinstance(message, dict) or message.get("to") != self.node_id:
            return  # requests, and answers meant for other nodes
        try:
            response = parse_sync_message(message)
        except pydantic.ValidationError as error:
            log.warning("malformed state-sync answer dropped: %s", error)
            return
        if isinstance(response, SyncResponse):
            self._adopt(response)

    def _adopt(self, response: SyncResponse) -> None:
        if self._following is not None and response.master != self._following:
            return
        try:
            state = apply_all(response.snapshot, response.tail)
        except ValueError as error:
            log.warning("state-sync answer from %s does not apply: %s", response.master, error)
            return
        synced_idx = -1 if state.last_event_idx is None else state.last_event_idx
        if (response.session == self.session and self.state.last_event_idx is not None
                and synced_idx <= self.state.last_event_idx):
            self._drain()  # we are already as far along
            return
        log.info("node %s synced to session %s of master %s at event %s", self.node_id,
                 response.session[:8], response.master, state.last_event_idx)
        self._start_session(response.session, response.master, state)
        self._callbacks.deliver(_RESET, state)
        self._drain()
        self._sync_sent_at = None

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.config.sync_timeout_s)
            if self.session is None or self._buffer or (
                    self._following is not None and self._following != self.master):
                self._request_sync()
