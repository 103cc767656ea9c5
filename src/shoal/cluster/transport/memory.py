"""An in-process transport: several nodes on one event loop share a MemoryHub.

Used by tests and by a single-process cluster. Messages take the same msgpack round trip as on
the network, are delivered on the next loop iteration (never inside publish), and keep per-sender
order. The hub can partition nodes and drop them, to test elections and failover.
"""

from __future__ import annotations

import asyncio
from typing import Any

from shoal.cluster.transport.base import (
    Callback,
    Fanout,
    OutboxStats,
    PeersCallback,
    Subscription,
    TransportError,
    decode,
    encode,
)
from shoal.cluster.transport.topics import Topic, check_node_id
from shoal.ids import NodeId

_DATA = "data"
_PEERS = "peers"


class MemoryHub:
    """The shared medium; reachability is all-to-all except across partitions."""

    def __init__(self) -> None:
        self._nodes: dict[NodeId, MemoryTransport] = {}
        self._group_of: dict[NodeId, int] = {}
        self._mute: set[frozenset[NodeId]] = set()  # pairs whose messages are lost

    def connect(self, node_id: str) -> MemoryTransport:
        node = check_node_id(node_id)
        if node in self._nodes:
            raise TransportError(f"node {node} is already connected to this hub")
        transport = MemoryTransport(self, node)
        self._nodes[node] = transport
        self._announce()
        return transport

    def drop(self, node_id: NodeId) -> None:
        """node vanishes at once, as a crashed process would; its transport goes silent."""
        transport = self._nodes.pop(node_id, None)
        self._group_of.pop(node_id, None)
        if transport is not None:
            transport._detach()
            self._announce()

    def partition(self, *groups: set[NodeId] | frozenset[NodeId]) -> None:
        """Only nodes in the same group reach each other; unnamed nodes form one more group."""
        self._group_of = {node: index for index, group in enumerate(groups) for node in group}
        self._announce()

    def mute(self, a: NodeId, b: NodeId) -> None:
        """Lose every message between a and b while each still counts the other present, as
        over a one-sided Zenoh link (transport/beacons.py); a and b still reach the rest."""
        self._mute.add(frozenset((a, b)))

    def heal(self) -> None:
        self._group_of = {}
        self._mute.clear()
        self._announce()

    def reannounce(self, node_id: NodeId) -> None:
        """Report node's unchanged peer set again, as a flapping link would."""
        transport = self._nodes.get(node_id)
        if transport is not None:
            transport._set_peers(self._reachable(node_id) - {node_id}, force=True)

    def _reachable(self, sender: NodeId) -> frozenset[NodeId]:
        group = self._group_of.get(sender, -1)
        return frozenset(node for node in self._nodes if self._group_of.get(node, -1) == group)

    def _announce(self) -> None:
        for node, transport in list(self._nodes.items()):
            transport._set_peers(self._reachable(node) - {node})

    def _send(self, sender: NodeId, targets: frozenset[NodeId], key: str, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        for node in targets:
            if frozenset((sender, node)) in self._mute:
                continue
            transport = self._nodes.get(node)
            if transport is not None:
                # Decoded per receiver so no two nodes share a mutable object.
                loop.call_soon(transport._deliver, key, data)


class MemoryTransport:
    """One node's end of a MemoryHub; implements the Transport protocol."""

    def __init__(self, hub: MemoryHub, node_id: NodeId) -> None:
        self._hub: MemoryHub | None = hub
        self._node_id = node_id
        self._fanout = Fanout()
        self._peers: frozenset[NodeId] = frozenset()

    @property
    def node_id(self) -> NodeId:
        return self._node_id

    @property
    def peers(self) -> frozenset[NodeId]:
        return self._peers

    def publish(self, topic: Topic, payload: Any) -> None:
        data = encode(payload)
        if self._hub is not None:
            self._hub._send(self._node_id, self._hub._reachable(self._node_id),
                            Topic(topic).value, data)

    def subscribe(self, topic: Topic, callback: Callback) -> Subscription:
        return self._fanout.add(Topic(topic).value, callback)

    def send_data(self, node: NodeId, payload: Any) -> None:
        data = encode(payload)
        if self._hub is not None and node in self._hub._reachable(self._node_id):
            self._hub._send(self._node_id, frozenset([node]), _DATA, data)

    def subscribe_data(self, callback: Callback) -> Subscription:
        return self._fanout.add(_DATA, callback)

    def on_peers_changed(self, callback: PeersCallback) -> Subscription:
        return self._fanout.add(_PEERS, callback)

    async def room(self, timeout_s: float) -> None:
        return None  # delivery is a call_soon: there is never a backlog

    @property
    def outbox_stats(self) -> OutboxStats:
        return OutboxStats()

    async def close(self) -> None:
        if self._hub is not None:
            self._hub.drop(self._node_id)

    def _deliver(self, key: str, data: bytes) -> None:
        if self._hub is not None:
            self._fanout.deliver(key, decode(data))

    def _set_peers(self, peers: frozenset[NodeId], force: bool = False) -> None:
        if peers == self._peers and not force:
            return
        self._peers = peers
        self._schedule(lambda: self._fanout.deliver(_PEERS, peers))

    def _detach(self) -> None:
        self._hub = None
        self._peers = frozenset()
        self._fanout.clear()

    def _schedule(self, call) -> None:
        try:
            asyncio.get_running_loop().call_soon(call)
        except RuntimeError:  # no loop yet (hub built before the test's loop): call now
            call()
