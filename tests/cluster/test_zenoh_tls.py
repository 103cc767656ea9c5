"""Zenoh sessions over mutual TLS, in one process on 127.0.0.1: sessions under one CA talk,
by explicit endpoints or by multicast scouting on the loopback interface; a session under
another CA, or without TLS, gets no link and no message."""

from __future__ import annotations

import asyncio
import socket

import pytest
from cluster_waits import wait_until

from shoal.cluster.certs import make_cluster_certs
from shoal.cluster.tls import read_cluster_tls
from shoal.cluster.transport import Topic
from shoal.cluster.transport.zenoh import ZenohConfig, ZenohTransport


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def two_cas(tmp_path):
    """This cluster's TLS files, and another cluster's."""
    for name in ("ours", "theirs"):
        make_cluster_certs(tmp_path / name)
    return read_cluster_tls(tmp_path / "ours"), read_cluster_tls(tmp_path / "theirs")


async def _listen_for_events(transport: ZenohTransport) -> list:
    got: list = []
    transport.subscribe(Topic.GLOBAL_EVENTS, got.append)
    return got


def test_nodes_under_one_ca_talk_and_another_ca_or_plain_tcp_gets_nothing(two_cas):
    ours, theirs = two_cas
    port_a, port_b = _free_port(), _free_port()
    tls_a = f"tls/127.0.0.1:{port_a}"

    def config(port: int, tls, connect=(tls_a,), scheme="tls") -> ZenohConfig:
        return ZenohConfig(listen=(f"{scheme}/127.0.0.1:{port}",), connect=connect,
                           multicast_scouting=False, secret="same-namespace", tls=tls)

    async def main():
        a = await ZenohTransport.open("node-a", config(port_a, ours, connect=()))
        b = await ZenohTransport.open("node-b", config(port_b, ours))
        # Same namespace secret, same endpoint: only the certificates differ.
        x = await ZenohTransport.open("node-x", config(_free_port(), theirs))
        plain = await ZenohTransport.open("node-p", config(
            _free_port(), None, connect=(f"tcp/127.0.0.1:{port_a}",), scheme="tcp"))
        try:
            heard = {name: await _listen_for_events(t)
                     for name, t in (("b", b), ("x", x), ("plain", plain))}
            await wait_until(lambda: a.peers == {"node-b"} and b.peers == {"node-a"},
                             timeout=10, what="a and b linked over TLS")
            await asyncio.sleep(0.5)  # subscriptions propagate; x and plain keep trying
            a.publish(Topic.GLOBAL_EVENTS, {"idx": 1})
            await wait_until(lambda: heard["b"], what="b hears a")
            await asyncio.sleep(0.3)
            return heard, a.peers, x.peers, plain.peers
        finally:
            for transport in (a, b, x, plain):
                await transport.close()

    heard, peers_a, peers_x, peers_plain = asyncio.run(main())
    assert heard["b"] == [{"idx": 1}]
    assert heard["x"] == [] and heard["plain"] == []
    assert peers_a == {"node-b"} and peers_x == frozenset() and peers_plain == frozenset()


def test_scouting_on_loopback_finds_nodes_under_the_same_ca_only(two_cas):
    ours, theirs = two_cas

    def config(tls) -> ZenohConfig:
        # No endpoints to dial: each node's scouting hello names its tls/ locator.
        return ZenohConfig(listen=("tls/127.0.0.1:0",), multicast_scouting=True,
                           scouting_interface="lo", secret="scouting-test", tls=tls)

    async def main():
        a = await ZenohTransport.open("node-a", config(ours))
        b = await ZenohTransport.open("node-b", config(ours))
        x = await ZenohTransport.open("node-x", config(theirs))
        try:
            found_in = await wait_until(lambda: a.peers == {"node-b"}
                                        and b.peers == {"node-a"}, timeout=10,
                                        what="a and b found each other")
            await asyncio.sleep(1.0)  # x has scouted them too by now
            return found_in, a.peers, x.peers
        finally:
            for transport in (a, b, x):
                await transport.close()

    _found_in, peers_a, peers_x = asyncio.run(main())
    assert peers_a == {"node-b"} and peers_x == frozenset()


def test_with_tls_every_endpoint_is_tls(two_cas):
    with pytest.raises(ValueError, match="with TLS, use tls/"):
        ZenohConfig(listen=("tcp/127.0.0.1:7447",), tls=two_cas[0])
