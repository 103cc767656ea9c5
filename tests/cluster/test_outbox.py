"""Publishing never blocks the event loop: puts wait in a bounded queue a thread drains, a
congested link drops best-effort messages (counted) and refuses the others with a clear
error, and a slow Zenoh put leaves the loop answering."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from cluster_waits import wait_until

from shoal.cluster.transport import Topic
from shoal.cluster.transport.outbox import Outbox, OutboxFull, OutboxLimits
from shoal.cluster.transport.zenoh import ZenohConfig, ZenohTransport


class CongestedLink:
    """A put that blocks until the test opens the link, as a full Zenoh queue would."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.sent: list[tuple[str, bytes]] = []

    def __call__(self, key: str, data: bytes, droppable: bool, express: bool) -> None:
        self.open.wait(10.0)
        self.sent.append((key, data))


async def loop_lateness(stop: asyncio.Event) -> float:
    """The worst lateness of a 5 ms sleep on this loop until stop is set."""
    worst = 0.0
    while not stop.is_set():
        started = time.monotonic()
        await asyncio.sleep(0.005)
        worst = max(worst, time.monotonic() - started - 0.005)
    return worst


def test_a_congested_link_drops_telemetry_and_keeps_every_event_in_order():
    async def main():
        link = CongestedLink()
        outbox = Outbox(link, asyncio.get_running_loop(), OutboxLimits(max_messages=400))
        stop = asyncio.Event()
        watcher = asyncio.create_task(loop_lateness(stop))
        for i in range(200):
            outbox.put("telemetry", b"reading", droppable=True, express=False)
            outbox.put("events", str(i).encode(), droppable=False, express=False)
            await asyncio.sleep(0)
        outbox.put("election", b"heartbeat", droppable=False, express=True)
        stats = outbox.stats
        link.open.set()
        await wait_until(lambda: outbox.stats.queued_messages == 0, what="queue drained")
        stop.set()
        await outbox.close()
        return link.sent, stats, await watcher

    sent, stats, lateness = asyncio.run(main())
    events = [data for key, data in sent if key == "events"]
    assert events == [str(i).encode() for i in range(200)]  # none lost, in order
    # Best-effort messages stop being queued at a quarter of the bound.
    assert stats.dropped > 0
    assert len([key for key, _ in sent if key == "telemetry"]) == 200 - stats.dropped
    assert ("election", b"heartbeat") in sent[:2]  # ahead of the backlog
    assert lateness < 0.1


def test_a_full_queue_refuses_what_must_not_be_dropped_with_a_clear_error():
    async def main():
        link = CongestedLink()
        outbox = Outbox(link, asyncio.get_running_loop(), OutboxLimits(max_messages=8))
        for i in range(8):
            outbox.put("data", bytes([i]), droppable=False, express=False)
        with pytest.raises(OutboxFull, match="congested: 8 messages"):
            outbox.put("data", b"x", droppable=False, express=False)
        started = time.monotonic()
        with pytest.raises(OutboxFull, match="stayed congested for 0.1 s"):
            await outbox.room(0.1)
        waited = time.monotonic() - started
        link.open.set()
        await outbox.room(2.0)  # drained: the sender may go on
        refused = outbox.stats.refused
        await outbox.close()
        return waited, refused, len(link.sent)

    waited, refused, sent = asyncio.run(main())
    assert 0.1 <= waited < 0.5
    assert refused == 1 and sent == 8


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class SlowSession:
    """A real Zenoh session whose every put takes put_s, as one to a congested peer does."""

    def __init__(self, session, put_s: float) -> None:
        self._session = session
        self._put_s = put_s

    def put(self, *args, **kwargs) -> None:
        time.sleep(self._put_s)
        self._session.put(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._session, name)


def test_a_slow_zenoh_put_leaves_the_event_loop_answering():
    async def main():
        opened = await ZenohTransport.open("node-a", ZenohConfig(
            listen=(f"tcp/127.0.0.1:{_free_port()}",), multicast_scouting=False))
        # The same session, wrapped so each put takes 20 ms.
        transport = ZenohTransport(opened.node_id, SlowSession(opened._session, 0.02),
                                   opened._namespace, asyncio.get_running_loop())
        got: list = []
        transport.subscribe(Topic.GLOBAL_EVENTS, got.append)
        await asyncio.sleep(0.1)
        stop = asyncio.Event()
        watcher = asyncio.create_task(loop_lateness(stop))
        started = time.monotonic()
        for i in range(40):  # 0.8 s of puts
            transport.publish(Topic.GLOBAL_EVENTS, {"idx": i})
        publishing = time.monotonic() - started
        await wait_until(lambda: len(got) == 40, what="every event heard")
        stop.set()
        lateness = await watcher
        await transport.close()
        await opened._outbox.close()
        return got, publishing, lateness

    got, publishing, lateness = asyncio.run(main())
    assert got == [{"idx": i} for i in range(40)]
    assert publishing < 0.1  # queued, not sent, on the loop
    assert lateness < 0.1
