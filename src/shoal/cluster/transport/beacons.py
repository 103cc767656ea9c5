"""Telling a working link from a one-sided one, for the Zenoh transport.

A peer's presence (its liveliness token) says that this node's session holds a link to it,
not that the peer still routes anything here. Zenoh 1.x can leave the two apart for good: when
both peers dial each other and only one side's lease expires during an outage (its link
closed, the other side's not yet), the side that closed reconnects into the other's still-open
transport. That side then starts afresh while the other keeps its old routes and key-expression
ids: its tokens and subscriptions are never sent again, so the fresh side never sees it come
back, and what it still publishes arrives on the fresh side under the old ids, on the wrong
topic (eclipse-zenoh/zenoh#2806, "reconnect merged into stale transport").

So every node sends a small beacon every `interval_s`, and a peer that is present but whose
beacons have not arrived for `stale_after_s` is silent: the link to it is one-sided, and the
transport reopens its session (closing it ends the stale transport on both sides).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from shoal.ids import NodeId


@dataclass(frozen=True)
class BeaconConfig:
    interval_s: float = 1.0
    # Past Zenoh's link lease (10 s), after which a peer merely cut off is no longer present;
    # a peer present and this quiet is held by a one-sided link.
    stale_after_s: float = 20.0
    # How long a reopened session's presence may take to come in (peers re-dial it) before
    # the peers it has not announced count as gone.
    settle_s: float = 5.0

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.settle_s < 0:
            raise ValueError("beacon interval_s must be positive and settle_s >= 0")
        if self.stale_after_s <= 3 * self.interval_s:
            raise ValueError(f"beacon stale_after_s must exceed three intervals "
                             f"({3 * self.interval_s:g}s)")


class SilentPeers:
    """When each present peer was last heard (or appeared). Thread-safe: beacons are heard on
    Zenoh's threads, presence changes on the event loop. Times are monotonic seconds."""

    def __init__(self, stale_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        self._lock = threading.Lock()
        self._last: dict[NodeId, float] = {}  # present peers only

    def present(self, node: NodeId, now: float) -> None:
        """node's presence appeared: it has stale_after_s from now to be heard."""
        with self._lock:
            self._last.setdefault(node, now)

    def gone(self, node: NodeId) -> None:
        with self._lock:
            self._last.pop(node, None)

    def clear(self) -> None:
        with self._lock:
            self._last.clear()

    def heard(self, node: NodeId, now: float) -> None:
        """A beacon from node (ignored unless node is present: a beacon may outrun its
        presence, and a peer that is not present cannot be silent)."""
        with self._lock:
            if node in self._last:
                self._last[node] = max(self._last[node], now)

    def silent(self, now: float) -> frozenset[NodeId]:
        """The present peers not heard from for stale_after_s."""
        with self._lock:
            return frozenset(node for node, last in self._last.items()
                             if now - last > self.stale_after_s)
