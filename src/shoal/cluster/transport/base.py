"""The Transport protocol every cluster part talks through, and helpers its implementations share.

Payloads are msgpack-able values (dicts, lists, str, bytes, numbers, bool, None); the transport
encodes them on send and decodes on receipt, so a receiver never shares objects with a sender.
Sending never blocks the event loop: a message is queued or, when the link stays congested,
dropped (best-effort topics only, counted) or refused with a TransportError.
Callbacks run on the event loop the transport was opened on, in arrival order per sender and
topic; a callback that raises is logged and does not disturb other subscribers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from shoal.cluster.transport.topics import Topic
from shoal.ids import NodeId

log = logging.getLogger("shoal.cluster.transport")

Callback = Callable[[Any], None]
PeersCallback = Callable[[frozenset[NodeId]], None]


class TransportError(RuntimeError):
    """The transport could not open, or a payload could not be encoded."""


@dataclass(frozen=True)
class OutboxStats:
    """A transport's queue of outgoing messages, as /metrics shows it."""

    queued_messages: int = 0
    queued_bytes: int = 0
    dropped: int = 0   # best-effort messages (telemetry, prefix updates) dropped
    refused: int = 0   # other messages refused because the link stayed congested
    failed: int = 0    # puts the network layer failed


class Subscription:
    """Handle returned by subscribe(); close() stops further deliveries."""

    def __init__(self, on_close: Callable[[], None]) -> None:
        self._on_close: Callable[[], None] | None = on_close

    def close(self) -> None:
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()


class Transport(Protocol):
    """One node's connection to its cluster."""

    @property
    def node_id(self) -> NodeId: ...

    @property
    def peers(self) -> frozenset[NodeId]:
        """Other nodes of this cluster currently connected (never this node)."""
        ...

    def publish(self, topic: Topic, payload: Any) -> None:
        """Broadcast payload on topic to every node of the cluster, this one included."""
        ...

    def subscribe(self, topic: Topic, callback: Callback) -> Subscription: ...

    def send_data(self, node: NodeId, payload: Any) -> None:
        """Send payload to node's data key (token chunks for the node that owns a request)."""
        ...

    def subscribe_data(self, callback: Callback) -> Subscription:
        """Receive what other nodes send to this node's data key."""
        ...

    def on_peers_changed(self, callback: PeersCallback) -> Subscription:
        """Call callback with the connected set whenever connectivity is reported.

        A report may repeat an unchanged set (links flap and re-dial); receivers that care
        about changes compare with the set they last acted on.
        """
        ...

    async def room(self, timeout_s: float) -> None:
        """Until a message that must not be dropped would be queued: back-pressure for bulk
        senders. TransportError after timeout_s of congestion."""
        ...

    @property
    def outbox_stats(self) -> OutboxStats: ...

    async def close(self) -> None: ...


def encode(payload: Any) -> bytes:
    try:
        return msgpack.packb(payload, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as error:
        raise TransportError(f"payload is not msgpack-able: {error}") from None


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class Fanout:
    """Callbacks registered per key (a topic, "data" or "peers"), called one by one."""

    def __init__(self) -> None:
        self._callbacks: dict[str, list[Callable[[Any], None]]] = {}

    def add(self, key: str, callback: Callable[[Any], None]) -> Subscription:
        self._callbacks.setdefault(key, []).append(callback)

        def remove() -> None:
            callbacks = self._callbacks.get(key, [])
            if callback in callbacks:
                callbacks.remove(callback)
        return Subscription(remove)

    def has(self, key: str) -> bool:
        return bool(self._callbacks.get(key))

    def deliver(self, key: str, value: Any) -> None:
        for callback in list(self._callbacks.get(key, ())):
            try:
                callback(value)
            except Exception:  # one faulty subscriber must not starve the others
                log.exception("subscriber of %s failed", key)

    def clear(self) -> None:
        self._callbacks.clear()


class Inbox:
    """One topic's messages as a bounded async queue: `async for message in inbox`.

    When the reader falls maxsize behind, the oldest message is dropped and counted, so a
    stalled reader costs bounded memory; `dropped` says how many were lost.
    """

    def __init__(self, transport: Transport, topic: Topic, maxsize: int = 1024) -> None:
        if maxsize < 1:
            raise ValueError("inbox maxsize must be >= 1")
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize)
        self.dropped = 0
        self._topic = topic
        self._subscription = transport.subscribe(topic, self._put)

    def _put(self, message: Any) -> None:
        if self._queue.full():
            self._queue.get_nowait()
            self.dropped += 1
            log.warning("inbox of %s full: dropped the oldest message (%d so far)",
                        self._topic, self.dropped)
        self._queue.put_nowait(message)

    async def get(self, timeout: float) -> Any:
        """The next message; TimeoutError after timeout seconds without one."""
        async with asyncio.timeout(timeout):
            return await self._queue.get()

    def __aiter__(self) -> Inbox:
        return self

    async def __anext__(self) -> Any:
        return await self._queue.get()

    def close(self) -> None:
        self._subscription.close()
