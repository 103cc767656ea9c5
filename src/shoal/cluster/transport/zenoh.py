"""The network transport: one Zenoh peer session per node. The only module that imports zenoh.

Peers find each other by multicast scouting on the LAN, or through explicit `connect`
endpoints (then scouting is off unless asked for; gossip still spreads what peers learn).
Presence is a liveliness token per node under the cluster namespace: Zenoh removes it when
the node's session closes or its link lease expires, which is what `peers` reports. A
beacon per node each second tells a present peer that routes nothing here any more (a
one-sided link, transport/beacons.py); the session is then reopened.
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
import threading
import time
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
from shoal.cluster.transport.beacons import BeaconConfig, SilentPeers
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
    beacons: BeaconConfig = field(default_factory=BeaconConfig)

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
    """Implements the Transport protocol on one Zenoh peer session; build with `open`.

    A peer that stays present but sends no beacon is held by a one-sided link
    (transport/beacons.py): the session is then closed and opened again, with every token and
    subscription declared anew, which only `open` can do (it keeps the config)."""

    def __init__(self, node_id: NodeId, session: zenoh.Session, namespace: Namespace,
                 loop: asyncio.AbstractEventLoop, outbox: OutboxLimits | None = None,
                 config: ZenohConfig | None = None) -> None:
        self._node_id = node_id
        self._namespace = namespace
        self._loop = loop
        self._config = config
        self._fanout = Fanout()
        self._keys: dict[str, str] = {}  # subscribed name -> key, declared on every session
        self._peers: frozenset[NodeId] = frozenset()
        self._closed = False
        beacons = config.beacons if config is not None else BeaconConfig()
        self._beacon_s = beacons.interval_s
        self._settle_s = beacons.settle_s
        self._silent = SilentPeers(beacons.stale_after_s)
        self._reopening = False
        self._reopen_task: asyncio.Task[None] | None = None
        self.reopened = 0  # sessions reopened because a peer fell silent
        # Cleared while the session is being replaced: the outbox's thread waits on it.
        self._usable = threading.Event()
        self._attach(session)
        self._outbox = Outbox(self._send, loop, outbox, name=f"zenoh-put-{node_id}")
        self._stop = threading.Event()
        self._beacon_thread = threading.Thread(target=self._beacon_loop, daemon=True,
                                               name=f"zenoh-beacon-{node_id}")
        self._beacon_thread.start()

    @classmethod
    async def open(cls, node_id: str, config: ZenohConfig) -> ZenohTransport:
        """Open the session (TransportError if an endpoint cannot be bound or is invalid)."""
        node = check_node_id(node_id)
        namespace = Namespace(config.secret)
        session = await _open_session(config)
        log.info("cluster transport open: node %s, namespace %s, listen %s, connect %s, "
                 "multicast scouting %s, %s", node, namespace.fingerprint,
                 ",".join(config.listen) or "auto", ",".join(config.connect) or "none",
                 "on" if config.scouting else "off",
                 f"mutual TLS under {config.tls.ca_cert}" if config.tls else "no TLS")
        return cls(node, session, namespace, asyncio.get_running_loop(), config=config)

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
        self._stop.set()
        self._fanout.clear()
        if self._reopen_task is not None:
            await self._reopen_task  # it sees _closed and stops
        await self._outbox.close()
        await asyncio.to_thread(self._beacon_thread.join, 2 * self._beacon_s)
        # Closing the session also withdraws the liveliness token and every subscriber.
        await _close_session(self._session)

    # --- the session: declared on open and again on every reopen --------------------------

    def _attach(self, session: zenoh.Session) -> None:
        """Declare this node's token, presence and beacon subscribers and every subscribed
        key on session. Callbacks of an earlier session are ignored from here on."""
        self._session = session
        generation = self._generation = object()
        self._announced: set[NodeId] = set()  # the peers this session reports present
        liveliness = session.liveliness()
        self._token = liveliness.declare_token(self._namespace.presence_key(self._node_id))
        self._presence = liveliness.declare_subscriber(
            self._namespace.presence_pattern,
            lambda sample: self._on_presence(generation, sample), history=True)
        self._beacons = session.declare_subscriber(
            self._namespace.beacon_pattern, self._on_beacon)
        self._subscribers = {name: self._subscriber(session, name, key)
                             for name, key in self._keys.items()}
        self._usable.set()

    def _subscriber(self, session: zenoh.Session, name: str, key: str) -> Any:
        return session.declare_subscriber(
            key, lambda sample: self._to_loop(self._on_sample, name, sample.payload.to_bytes()))

    def _declare(self, name: str, key: str) -> None:
        if name in self._keys or self._closed:
            return
        self._keys[name] = key
        self._subscribers[name] = self._subscriber(self._session, name, key)

    def _put(self, key: str, data: bytes, droppable: bool, express: bool) -> None:
        if self._closed:
            raise TransportError("the cluster transport is closed")
        self._outbox.put(key, data, droppable, express)

    def _send(self, key: str, data: bytes, droppable: bool, express: bool) -> None:
        # On the outbox's thread: a BLOCK put may wait here for a congested link, and every
        # put waits while the session is being replaced.
        if not self._usable.wait(2 * _OPEN_TIMEOUT_S):
            raise TransportError("the cluster session is being reopened")
        congestion = zenoh.CongestionControl.DROP if droppable else zenoh.CongestionControl.BLOCK
        self._session.put(key, data, congestion_control=congestion, express=express)

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

    def _on_presence(self, generation: object, sample: zenoh.Sample) -> None:
        node = self._namespace.node_from_presence_key(str(sample.key_expr))
        if node is not None and node != self._node_id:
            self._to_loop(self._set_presence, generation, node,
                          sample.kind == zenoh.SampleKind.PUT)

    def _set_presence(self, generation: object, node: NodeId, present: bool) -> None:
        if generation is not self._generation:
            return  # a withdrawal reported by the session just replaced
        if present:
            self._announced.add(node)
            self._silent.present(node, time.monotonic())
        else:
            self._announced.discard(node)
            self._silent.gone(node)
        # While the session is reopened, only arrivals count: the new session's presence is
        # still coming in, and the peers it has not announced yet have not left.
        self._set_peers(self._peers | self._announced if self._reopening
                        else frozenset(self._announced))

    def _set_peers(self, peers: frozenset[NodeId]) -> None:
        for node in peers ^ self._peers:
            log.info("peer %s %s", node, "joined" if node in peers else "left")
        self._peers = peers
        self._fanout.deliver(_PEERS, peers)

    # --- beacons: a present peer that falls silent means a one-sided link ------------------

    def _on_beacon(self, sample: zenoh.Sample) -> None:
        # On a Zenoh thread, so a busy event loop here does not make a peer look silent.
        node = self._namespace.node_from_beacon_key(str(sample.key_expr))
        if node is not None:
            self._silent.heard(node, time.monotonic())

    def _beacon_loop(self) -> None:
        key = self._namespace.beacon_key(self._node_id)
        while not self._stop.wait(self._beacon_s):
            if self._usable.is_set():
                try:
                    # Its own priority lane, never blocking: a link saturated by bulk data
                    # still carries it.
                    self._session.put(key, b"", congestion_control=zenoh.CongestionControl.DROP,
                                      priority=zenoh.Priority.INTERACTIVE_HIGH, express=True)
                except zenoh.ZError:
                    pass  # the session is closing; the next beacon goes on the new one
            silent = self._silent.silent(time.monotonic())
            if silent:
                self._to_loop(self._start_reopen, silent)

    def _start_reopen(self, silent: frozenset[NodeId]) -> None:
        if self._reopening or self._closed:
            return
        if self._config is None:
            log.warning("peers %s are present but silent; this transport cannot reopen its "
                        "session", ", ".join(sorted(silent)))
            self._silent.clear()
            return
        self._reopening = True
        self._reopen_task = self._loop.create_task(self._reopen(self._config, silent),
                                                   name="zenoh-reopen")

    async def _reopen(self, config: ZenohConfig, silent: frozenset[NodeId]) -> None:
        log.warning("peer(s) %s present but silent for %g s: the links to them are "
                    "one-sided (a reconnect merged into a transport the peer had closed); "
                    "reopening this node's cluster session", ", ".join(sorted(silent)),
                    self._silent.stale_after_s)
        self._usable.clear()
        self._generation = object()  # the closing session's callbacks are stale from now
        self._silent.clear()
        try:
            await _close_session(self._session)
            while not self._closed:
                try:
                    session = await _open_session(config)
                except TransportError as error:  # e.g. the listen port not yet released
                    log.warning("reopening the cluster session failed (retrying): %s", error)
                    await asyncio.sleep(self._beacon_s)
                    continue
                if self._closed:
                    await _close_session(session)
                    return
                self._attach(session)
                self.reopened += 1
                log.info("cluster session reopened")
                # Peers keep their place until the new session's presence has come in (a
                # master that saw them all go would step down), then it alone counts.
                await asyncio.sleep(self._settle_s)
                self._set_peers(frozenset(self._announced))
                return
        finally:
            self._reopening = False


async def _open_session(config: ZenohConfig) -> zenoh.Session:
    try:
        async with asyncio.timeout(_OPEN_TIMEOUT_S):
            return await asyncio.to_thread(zenoh.open, _session_config(config))
    except TimeoutError:
        raise TransportError(f"zenoh session did not open within {_OPEN_TIMEOUT_S:g}s") \
            from None
    except zenoh.ZError as error:
        raise TransportError(f"cannot open the cluster transport: {error}") from None


async def _close_session(session: zenoh.Session) -> None:
    if session.is_closed():
        return
    try:
        async with asyncio.timeout(_OPEN_TIMEOUT_S):
            await asyncio.to_thread(session.close)
    except TimeoutError:
        log.warning("zenoh session did not close within %gs", _OPEN_TIMEOUT_S)
