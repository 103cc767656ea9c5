"""The network transport: one Zenoh peer session per node. The only module that imports zenoh.

Peers find each other by multicast scouting on the LAN, or through explicit `connect`
endpoints (then scouting is off unless asked for; gossip still spreads what peers learn).
Presence is a liveliness token per node under the cluster namespace: Zenoh removes it when
the node's session closes or its link lease expires, which is what `peers` reports.
With TLS (cluster/tls.py) every link is mutual TLS under the cluster CA and no other
protocol is spoken; scouting still works, as a node's hello names its tls/ locators.
Zenoh calls back on its own threads; everything is handed to the event loop in arrival order.
Puts go the other way: queued on the loop, sent by the outbox's thread (outbox.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import zenoh

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
from shoal.cluster.tls import ClusterTls
from shoal.cluster.transport.outbox import Outbox, OutboxLimits
from shoal.cluster.transport.topics import Namespace, Topic, check_node_id
from shoal.ids import NodeId

log = logging.getLogger("shoal.cluster.transport")

_ENDPOINT = re.compile(r"(tcp|udp|tls|quic)/(\[[0-9A-Fa-f:.]+\]|[^/\s:\[\]]+):\d{1,5}")
_DATA = "data"
_PEERS = "peers"
# Best-effort topics may drop under congestion; everything else blocks the sending thread
# (bounded by Zenoh's own link timeout; never the loop: outbox.py) rather than lose a
# command or an indexed event. Prefix updates are repaired by the next snapshot
# (cluster/prefix_share.py).
_DROPPABLE = {Topic.TELEMETRY.value, Topic.PREFIXES.value}
_OPEN_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ZenohConfig:
    """How this node's Zenoh session listens, connects and discovers peers."""

    # Endpoints such as tcp/192.168.1.5:7447; empty lets Zenoh pick (all interfaces, any port).
    listen: tuple[str, ...] = ()
    connect: tuple[str, ...] = ()
    # None: scout by multicast unless explicit connect endpoints are given.
    multicast_scouting: bool | None = None
    secret: str = field(default="", repr=False)
    # Mutual TLS under the cluster CA on every link; None: plain TCP (or what endpoints say).
    tls: ClusterTls | None = None
    # The network interface multicast scouting uses (e.g. "lo"); empty: Zenoh picks.
    scouting_interface: str = ""

    def __post_init__(self) -> None:
        for endpoint in (*self.listen, *self.connect):
            if not _ENDPOINT.fullmatch(endpoint):
                raise ValueError(f"invalid endpoint {endpoint!r}: use PROTO/HOST:PORT, "
                                 f"for example tcp/192.168.1.5:7447")
            if int(endpoint.rsplit(":", 1)[1]) > 65535:
                raise ValueError(f"invalid endpoint {endpoint!r}: port must be <= 65535")
            if self.tls is not None and not endpoint.startswith("tls/"):
                raise ValueError(f"invalid endpoint {endpoint!r}: with TLS, use tls/HOST:PORT")

    @property
    def scouting(self) -> bool:
        return (not self.connect) if self.multicast_scouting is None else self.multicast_scouting


def _session_config(config: ZenohConfig) -> zenoh.Config:
    settings = zenoh.Config()
    settings.insert_json5("mode", '"peer"')
    listen = config.listen or (("tls/[::]:0",) if config.tls is not None else ())
    if listen:
        settings.insert_json5("listen/endpoints", json.dumps(list(listen)))
    settings.insert_json5("connect/endpoints", json.dumps(list(config.connect)))
    settings.insert_json5("scouting/multicast/enabled", json.dumps(config.scouting))
    if config.scouting_interface:
        settings.insert_json5("scouting/multicast/interface",
                              json.dumps(config.scouting_interface))
    if config.tls is not None:
        settings.insert_json5("transport/link/tls", json.dumps(_tls_settings(config.tls)))
        # Neither accept nor open a link of any other kind (a scouted tcp/ locator included).
        settings.insert_json5("transport/link/protocols", '["tls"]')
    return settings


def _tls_settings(tls: ClusterTls) -> dict[str, Any]:
    """Both roles show the node certificate and accept only peers the CA signed. Names are
    not checked: every node holds the same CA-signed key, so a name proves nothing more."""
    return {"root_ca_certificate": str(tls.ca_cert),
            "listen_certificate": str(tls.node_cert), "listen_private_key": str(tls.node_key),
            "connect_certificate": str(tls.node_cert),
            "connect_private_key": str(tls.node_key),
            "enable_mtls": True, "verify_name_on_connect": False}


class ZenohTransport:
    """Implements the Transport protocol on one Zenoh peer session; build with `open`."""

    def __init__(self, node_id: NodeId, session: zenoh.Session, namespace: Namespace,
                 loop: asyncio.AbstractEventLoop, outbox: OutboxLimits | None = None) -> None:
        self._node_id = node_id
        self._session = session
        self._namespace = namespace
        self._loop = loop
        self._fanout = Fanout()
        self._subscribers: dict[str, Any] = {}
        self._peers: frozenset[NodeId] = frozenset()
        self._closed = False
        self._outbox = Outbox(self._send, loop, outbox, name=f"zenoh-put-{node_id}")
        self._token = session.liveliness().declare_token(namespace.presence_key(node_id))
        self._presence = session.liveliness().declare_subscriber(
            namespace.presence_pattern, self._on_presence, history=True)

    @classmethod
    async def open(cls, node_id: str, config: ZenohConfig) -> ZenohTransport:
        """Open the session (TransportError if an endpoint cannot be bound or is invalid)."""
        node = check_node_id(node_id)
        namespace = Namespace(config.secret)
        try:
            async with asyncio.timeout(_OPEN_TIMEOUT_S):
                session = await asyncio.to_thread(zenoh.open, _session_config(config))
        except TimeoutError:
            raise TransportError(f"zenoh session did not open within {_OPEN_TIMEOUT_S:g}s") \
                from None
        except zenoh.ZError as error:
            raise TransportError(f"cannot open the cluster transport: {error}") from None
        log.info("cluster transport open: node %s, namespace %s, listen %s, connect %s, "
                 "multicast scouting %s, %s", node, namespace.fingerprint,
                 ",".join(config.listen) or "auto", ",".join(config.connect) or "none",
                 "on" if config.scouting else "off",
                 f"mutual TLS under {config.tls.ca_cert}" if config.tls else "no TLS")
        return cls(node, session, namespace, asyncio.get_running_loop())

    @property
    def node_id(self) -> NodeId:
        return self._node_id

    @property
    def peers(self) -> frozenset[NodeId]:
        return self._peers

    def publish(self, topic: Topic, payload: Any) -> None:
        topic = Topic(topic)
        self._put(self._namespace.topic_key(topic), encode(payload),
                  droppable=topic.value in _DROPPABLE, express=topic is Topic.ELECTION)

    def subscribe(self, topic: Topic, callback: Callback) -> Subscription:
        name = Topic(topic).value
        self._declare(name, self._namespace.topic_key(Topic(topic)))
        return self._fanout.add(name, callback)

    def send_data(self, node: NodeId, payload: Any) -> None:
        self._put(self._namespace.data_key(node), encode(payload), droppable=False,
                  express=False)

    def subscribe_data(self, callback: Callback) -> Subscription:
        self._declare(_DATA, self._namespace.data_key(self._node_id))
        return self._fanout.add(_DATA, callback)

    def on_peers_changed(self, callback: PeersCallback) -> Subscription:
        return self._fanout.add(_PEERS, callback)

    async def room(self, timeout_s: float) -> None:
        await self._outbox.room(timeout_s)

    @property
    def outbox_stats(self) -> OutboxStats:
        return self._outbox.stats

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fanout.clear()
        await self._outbox.close()
        # Closing the session also withdraws the liveliness token and every subscriber.
        try:
            async with asyncio.timeout(_OPEN_TIMEOUT_S):
                await asyncio.to_thread(self._session.close)
        except TimeoutError:
            log.warning("zenoh session did not close within %gs", _OPEN_TIMEOUT_S)

    def _put(self, key: str, data: bytes, droppable: bool, express: bool) -> None:
        if self._closed:
            raise TransportError("the cluster transport is closed")
        self._outbox.put(key, data, droppable, express)

    def _send(self, key: str, data: bytes, droppable: bool, express: bool) -> None:
        # On the outbox's thread: a BLOCK put may wait here for a congested link.
        congestion = zenoh.CongestionControl.DROP if droppable else zenoh.CongestionControl.BLOCK
        self._session.put(key, data, congestion_control=congestion, express=express)

    def _declare(self, name: str, key: str) -> None:
        if name in self._subscribers or self._closed:
            return
        self._subscribers[name] = self._session.declare_subscriber(
            key, lambda sample: self._to_loop(self._on_sample, name, sample.payload.to_bytes()))

    def _to_loop(self, handler, *args) -> None:
        # Runs on a Zenoh thread: hand over to the loop, or drop silently once it is gone
        # (only during shutdown).
        try:
            self._loop.call_soon_threadsafe(handler, *args)
        except RuntimeError:
            pass

    def _on_sample(self, name: str, data: bytes) -> None:
        try:
            message = decode(data)
        except ValueError as error:
            log.warning("undecodable message on %s dropped: %s", name, error)
            return
        self._fanout.deliver(name, message)

    def _on_presence(self, sample: zenoh.Sample) -> None:
        node = self._namespace.node_from_presence_key(str(sample.key_expr))
        if node is not None and node != self._node_id:
            self._to_loop(self._set_presence, node, sample.kind == zenoh.SampleKind.PUT)

    def _set_presence(self, node: NodeId, present: bool) -> None:
        peers = self._peers | {node} if present else self._peers - {node}
        if peers != self._peers:
            log.info("peer %s %s", node, "joined" if present else "left")
        self._peers = peers
        self._fanout.deliver(_PEERS, peers)
