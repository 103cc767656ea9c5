"""Wire messages of the replicated event stream: global events and state sync.

Every master run is a session with its own id and its own indices from 0 (event 0 is
SessionStarted), so an IndexedEvent travels inside a SessionEvent that says which session
and master it belongs to. A follower that misses events, or joins late, asks with a
SyncRequest; the master answers that node with a snapshot and the log tail after it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter

from shoal.cluster.events import IndexedEvent
from shoal.cluster.instances import Frozen
from shoal.cluster.state import ClusterState
from shoal.ids import NodeId


class SessionEvent(Frozen):
    """One indexed event of a master session (topic global_events)."""

    session: str
    master: NodeId
    indexed: IndexedEvent


class SyncRequest(Frozen):
    kind: Literal["request"] = "request"
    node: NodeId


class SyncResponse(Frozen):
    """snapshot (the state at snapshot.last_event_idx) then tail (the events after it)."""

    kind: Literal["response"] = "response"
    to: NodeId
    session: str
    master: NodeId
    snapshot: ClusterState
    tail: tuple[IndexedEvent, ...] = ()


SyncMessage = Annotated[SyncRequest | SyncResponse, Field(discriminator="kind")]
_sync_messages: TypeAdapter[SyncMessage] = TypeAdapter(SyncMessage)


def parse_sync_message(raw: Any) -> SyncRequest | SyncResponse:
    """A state-sync message from its wire dict (pydantic.ValidationError if malformed)."""
    return _sync_messages.validate_python(raw)
