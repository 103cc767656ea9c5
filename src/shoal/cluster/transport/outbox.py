"""Puts handed off the event loop: a bounded queue that one thread drains.

A network put may block (a congested peer fills the link's queue, and Zenoh's reliable puts
wait for room), and on the event loop that would stall the whole control plane: elections,
heartbeats, every request. So the loop only queues; a thread sends.

Best-effort messages (telemetry, prefix updates) are dropped and counted once the queue is a
quarter full, so they never crowd out the rest. Every other message (events, commands, data)
is queued while there is room and refused with OutboxFull otherwise: a clear error, never a
silent loss. Bulk senders wait for room first (`room`), which is their back-pressure.
Election messages go ahead of the queue, so a backlog of data cannot delay a heartbeat past
the master timeout.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from shoal.cluster.transport.base import OutboxStats, TransportError

log = logging.getLogger("shoal.cluster.transport")

# send(key, data, droppable, express): the blocking put the thread makes.
Send = Callable[[str, bytes, bool, bool], None]


class OutboxFull(TransportError):
    """A message that must not be dropped found no room: the link is congested."""


@dataclass(frozen=True)
class OutboxLimits:
    max_messages: int = 4096
    max_bytes: int = 64 * 1024 * 1024
    # How long close() lets the thread send what is queued before the session closes.
    flush_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_messages < 4 or self.max_bytes < 4:
            raise ValueError("outbox limits must allow at least 4 messages and 4 bytes")
        if self.flush_s < 0:
            raise ValueError("outbox flush_s must be >= 0")


@dataclass(frozen=True)
class _Message:
    key: str
    data: bytes
    droppable: bool
    express: bool


class Outbox:
    """put() on the loop never blocks; a daemon thread calls send() for each message."""

    def __init__(self, send: Send, loop: asyncio.AbstractEventLoop,
                 limits: OutboxLimits | None = None, name: str = "outbox") -> None:
        self._send = send
        self._loop = loop
        self.limits = limits or OutboxLimits()
        self._urgent: deque[_Message] = deque()
        self._queue: deque[_Message] = deque()
        self._bytes = 0
        self._lock = threading.Condition()
        self._closing = False
        self._stats = {"dropped": 0, "refused": 0, "failed": 0}
        # Set while a sender waiting in room() may go on; cleared above the high mark and set
        # again once the thread has drained to half of it.
        self._room = asyncio.Event()
        self._room.set()
        self._thread = threading.Thread(target=self._drain, name=name, daemon=True)
        self._thread.start()

    @property
    def stats(self) -> OutboxStats:
        with self._lock:
            return OutboxStats(queued_messages=len(self._queue) + len(self._urgent),
                               queued_bytes=self._bytes, **self._stats)

    def put(self, key: str, data: bytes, droppable: bool, express: bool) -> None:
        """Queue one message. A best-effort one may be dropped; any other is queued or
        refused with OutboxFull; TransportError once the outbox is closing."""
        message = _Message(key, data, droppable, express)
        with self._lock:
            if self._closing:
                raise TransportError("the cluster transport is closed")
            if express:
                self._put_urgent(message)
            elif droppable and self._filled(1, len(data)) > 0.25:
                self._stats["dropped"] += 1
                return
            elif not droppable and self._filled(1, len(data)) > 1.0 and self._queue:
                self._stats["refused"] += 1
                raise OutboxFull(
                    f"the cluster link is congested: {len(self._queue)} messages "
                    f"({self._bytes / 2**20:.1f} MiB) are still waiting to be sent")
            else:
                self._queue.append(message)
                self._bytes += len(data)
            if self._filled(0, 0) > 0.75:
                self._room.clear()
            self._lock.notify()

    def _put_urgent(self, message: _Message) -> None:
        # Election messages are small and repeated every heartbeat: past the bound the
        # oldest goes (a newer one says the same), so a stuck link cannot grow this lane.
        if len(self._urgent) >= self.limits.max_messages:
            self._bytes -= len(self._urgent.popleft().data)
            self._stats["dropped"] += 1
        self._urgent.append(message)
        self._bytes += len(message.data)

    async def room(self, timeout_s: float) -> None:
        """Until the queue has drained below its high mark; OutboxFull after timeout_s."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._room.wait()
        except TimeoutError:
            raise OutboxFull(f"the cluster link stayed congested for {timeout_s:g} s "
                             f"({self.stats.queued_messages} messages waiting)") from None

    async def close(self) -> None:
        """Refuse new messages, let the thread send what is queued (within flush_s)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._lock.notify()
        await asyncio.to_thread(self._thread.join, self.limits.flush_s)
        with self._lock:
            left = len(self._queue) + len(self._urgent)
            self._queue.clear()
            self._urgent.clear()
        if left:
            log.warning("cluster transport closed with %d messages unsent", left)

    def _filled(self, extra_messages: int, extra_bytes: int) -> float:
        """The larger of the two bounds' fill ratios, with one more message if asked."""
        return max((len(self._queue) + extra_messages) / self.limits.max_messages,
                   (self._bytes + extra_bytes) / self.limits.max_bytes)

    def _drain(self) -> None:
        while True:
            with self._lock:
                while not (self._urgent or self._queue or self._closing):
                    self._lock.wait()
                if not (self._urgent or self._queue):
                    return  # closing, and everything was sent
                message = (self._urgent or self._queue).popleft()
            try:
                self._send(message.key, message.data, message.droppable, message.express)
            except Exception as error:  # noqa: BLE001 - the thread must outlive one bad put
                with self._lock:
                    self._stats["failed"] += 1
                log.warning("cluster put on %s failed: %s", message.key, error)
            with self._lock:
                self._bytes -= len(message.data)
                drained = self._filled(0, 0) <= 0.5
            if drained and not self._room.is_set():
                self._wake_senders()

    def _wake_senders(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._room.set)
        except RuntimeError:  # the loop is gone (shutdown): nobody waits any more
            pass
