"""The in-memory transport: delivery, ordering, data keys, peers, partitions and isolation."""

from __future__ import annotations

import asyncio

import pytest
from cluster_waits import wait_until

from shoal.cluster.transport import Inbox, MemoryHub, Namespace, Topic, TransportError
from shoal.ids import NodeId


def test_publish_reaches_every_node_in_order_including_the_sender():
    async def main():
        hub = MemoryHub()
        a, b = hub.connect("a"), hub.connect("b")
        got = {"a": [], "b": []}
        a.subscribe(Topic.COMMANDS, got["a"].append)
        b.subscribe(Topic.COMMANDS, got["b"].append)
        b.subscribe(Topic.TELEMETRY, lambda m: got["b"].append(("telemetry", m)))
        for i in range(5):
            a.publish(Topic.COMMANDS, {"i": i, "blob": b"\x00\x01"})
        assert got == {"a": [], "b": []}  # never delivered inside publish
        await wait_until(lambda: len(got["a"]) == len(got["b"]) == 5)
        return got

    got = asyncio.run(main())
    assert [m["i"] for m in got["b"]] == [0, 1, 2, 3, 4]
    assert got["a"][0] == {"i": 0, "blob": b"\x00\x01"}
    assert got["a"][0] is not got["b"][0]


def test_data_goes_only_to_the_addressed_node():
    async def main():
        hub = MemoryHub()
        a, b, c = hub.connect("a"), hub.connect("b"), hub.connect("c")
        got = {"a": [], "b": [], "c": []}
        for name, t in (("a", a), ("b", b), ("c", c)):
            t.subscribe_data(got[name].append)
        a.send_data(NodeId("b"), {"seq": 1})
        await wait_until(lambda: got["b"])
        await asyncio.sleep(0.02)
        return got

    assert asyncio.run(main()) == {"a": [], "b": [{"seq": 1}], "c": []}


def test_peers_partition_heal_and_drop():
    async def main():
        hub = MemoryHub()
        a, b, c = hub.connect("a"), hub.connect("b"), hub.connect("c")
        reports = []
        a.on_peers_changed(reports.append)
        assert a.peers == {"b", "c"}
        got = []
        c.subscribe(Topic.ELECTION, got.append)
        hub.partition({"a", "b"}, {"c"})
        assert a.peers == {"b"} and c.peers == frozenset()
        a.publish(Topic.ELECTION, "hello")
        await asyncio.sleep(0.02)
        assert got == []
        hub.heal()
        hub.drop(NodeId("b"))
        assert a.peers == {"c"}
        await asyncio.sleep(0.02)
        b_publish_after_drop = b.peers
        return reports, b_publish_after_drop

    reports, b_peers = asyncio.run(main())
    assert reports[-3:] == [{"b"}, {"b", "c"}, {"c"}]
    assert b_peers == frozenset()


def test_reannounce_repeats_an_unchanged_set():
    async def main():
        hub = MemoryHub()
        a = hub.connect("a")
        hub.connect("b")
        await asyncio.sleep(0)
        reports = []
        a.on_peers_changed(reports.append)
        hub.reannounce(NodeId("a"))
        await asyncio.sleep(0.01)
        return reports

    assert asyncio.run(main()) == [{"b"}]


def test_bad_payloads_and_ids_are_refused():
    async def main():
        hub = MemoryHub()
        a = hub.connect("a")
        with pytest.raises(TransportError, match="msgpack"):
            a.publish(Topic.COMMANDS, {"x": object()})
        with pytest.raises(TransportError, match="already connected"):
            hub.connect("a")

    asyncio.run(main())
    with pytest.raises(ValueError, match="invalid node id"):
        MemoryHub().connect("a/b")


def test_inbox_iterates_and_bounds_its_queue():
    async def main():
        hub = MemoryHub()
        a = hub.connect("a")
        inbox = Inbox(a, Topic.LOCAL_EVENTS, maxsize=2)
        for i in range(3):
            a.publish(Topic.LOCAL_EVENTS, i)
        await asyncio.sleep(0.01)
        first = await inbox.get(timeout=1)
        second = await anext(aiter(inbox))
        with pytest.raises(TimeoutError):
            await inbox.get(timeout=0.01)
        return first, second, inbox.dropped

    assert asyncio.run(main()) == (1, 2, 1)


def test_namespace_depends_on_the_secret_and_hides_it():
    one, same, other = Namespace("s3cret"), Namespace("s3cret"), Namespace("other")
    assert one == same and one != other
    assert one.topic_key(Topic.COMMANDS) != other.topic_key(Topic.COMMANDS)
    assert "s3cret" not in one.topic_key(Topic.COMMANDS) + repr(one) + one.fingerprint
    assert one.fingerprint not in one.topic_key(Topic.COMMANDS)
    assert one.node_from_presence_key(one.presence_key(NodeId("n1"))) == "n1"
    assert other.node_from_presence_key(one.presence_key(NodeId("n1"))) is None
