"""Real Zenoh sessions in one process, on 127.0.0.1 only (explicit endpoints, no scouting)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time

import pytest
from cluster_waits import wait_until

from shoal.cluster.control_plane import ClusterConfig, ControlPlane
from shoal.cluster.election import ElectionConfig
from shoal.cluster.master import MasterConfig
from shoal.cluster.replica import ReplicaConfig
from shoal.cluster.telemetry import NodeReading, TelemetryConfig
from shoal.cluster.transport import Topic, TransportError
from shoal.cluster.transport.beacons import BeaconConfig, SilentPeers
from shoal.cluster.transport.zenoh import ZenohConfig, ZenohTransport
from shoal.ids import NodeId


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _config(port: int, connect: tuple[int, ...] = (), secret: str = "s3cret") -> ZenohConfig:
    return ZenohConfig(listen=(f"tcp/127.0.0.1:{port}",),
                       connect=tuple(f"tcp/127.0.0.1:{p}" for p in connect),
                       multicast_scouting=False, secret=secret)


def test_two_sessions_talk_and_another_secret_sees_nothing(caplog):
    caplog.set_level(logging.INFO, logger="shoal.cluster")
    port_a, port_b, port_x = _free_port(), _free_port(), _free_port()

    async def main():
        a = await ZenohTransport.open("node-a", _config(port_a))
        b = await ZenohTransport.open("node-b", _config(port_b, connect=(port_a,)))
        # Same endpoints, other secret: it links at the Zenoh level but shares no keys.
        x = await ZenohTransport.open("node-x", _config(port_x, connect=(port_a, port_b),
                                                        secret="other"))
        try:
            got = {name: [] for name in ("a", "b", "x", "b_data", "x_data")}
            a.subscribe(Topic.GLOBAL_EVENTS, got["a"].append)
            b.subscribe(Topic.GLOBAL_EVENTS, got["b"].append)
            x.subscribe(Topic.GLOBAL_EVENTS, got["x"].append)
            b.subscribe_data(got["b_data"].append)
            x.subscribe_data(got["x_data"].append)
            await wait_until(lambda: a.peers == {"node-b"} and b.peers == {"node-a"},
                             what="peers discovered")
            await asyncio.sleep(0.2)  # let subscriptions propagate
            for i in range(3):
                a.publish(Topic.GLOBAL_EVENTS, {"idx": i})
            a.send_data(NodeId("node-b"), {"chunk": b"tok"})
            a.send_data(NodeId("node-x"), {"chunk": b"leak"})
            x.publish(Topic.GLOBAL_EVENTS, {"idx": 99})
            await wait_until(lambda: len(got["b"]) == 3 and got["b_data"], what="delivery")
            await asyncio.sleep(0.2)
            peers = (a.peers, b.peers, x.peers)
            await b.close()
            await wait_until(lambda: a.peers == frozenset(), what="peer b gone")
            return got, peers
        finally:
            for transport in (a, b, x):
                await transport.close()

    got, (peers_a, peers_b, peers_x) = asyncio.run(main())
    assert got["b"] == [{"idx": 0}, {"idx": 1}, {"idx": 2}]
    assert got["a"] == got["b"]  # the sender hears itself too
    assert got["b_data"] == [{"chunk": b"tok"}]
    assert got["x"] == [{"idx": 99}] and got["x_data"] == []
    assert peers_a == {"node-b"} and peers_b == {"node-a"} and peers_x == frozenset()
    assert "s3cret" not in caplog.text


def test_config_validation_and_bind_errors():
    with pytest.raises(ValueError, match="invalid endpoint"):
        ZenohConfig(listen=("127.0.0.1:7447",))
    with pytest.raises(ValueError, match="port must be"):
        ZenohConfig(connect=("tcp/127.0.0.1:99999",))
    assert ZenohConfig().scouting is True
    assert ZenohConfig(connect=("tcp/10.0.0.2:7447",)).scouting is False
    assert "hidden" not in repr(ZenohConfig(secret="hidden"))

    port = _free_port()

    async def main():
        first = await ZenohTransport.open("n1", _config(port))
        try:
            with pytest.raises(TransportError, match="cannot open"):
                await ZenohTransport.open("n2", _config(port))
        finally:
            await first.close()

    asyncio.run(main())


def test_two_control_planes_form_one_cluster_and_another_secret_stays_apart(tmp_path):
    fast = dict(election=ElectionConfig(campaign_s=0.3, heartbeat_s=0.05, master_timeout_s=1.0),
                telemetry=TelemetryConfig(interval_s=0.05, timeout_s=1.0),
                replica=ReplicaConfig(sync_timeout_s=0.2),
                master=MasterConfig(settle_grace_s=5, reconcile_s=0.05))
    ports = [_free_port() for _ in range(3)]

    def reader(name: str):
        return lambda: NodeReading(node_id=NodeId(name), taken_at=time.time(), name=name,
                                   memory_total=8 * 2**30, memory_available=4 * 2**30)

    async def main():
        planes = []
        for name, port, connect, secret in (("n1", ports[0], (), "s3cret"),
                                            ("n2", ports[1], (ports[0],), "s3cret"),
                                            ("n9", ports[2], (ports[0],), "other")):
            transport = await ZenohTransport.open(name, _config(port, connect, secret))
            plane = ControlPlane(transport, ClusterConfig(event_log_dir=tmp_path / name, **fast),
                                 reader(name))
            await plane.start()
            planes.append(plane)
        n1, n2, n9 = planes
        try:
            await wait_until(lambda: all(set(p.replica.state.nodes) == {"n1", "n2"}
                                         for p in (n1, n2))
                             and n1.replica.master == n2.replica.master is not None,
                             timeout=10, what="n1 and n2 form one cluster")
            await wait_until(lambda: set(n9.replica.state.nodes) == {"n9"}, timeout=10)
            return (n1.replica.state == n2.replica.state, n9.replica.master,
                    n9.transport.peers)
        finally:
            for plane in planes:
                await plane.stop()
                await plane.transport.close()

    same_state, other_master, other_peers = asyncio.run(main())
    assert same_state and other_master == "n9" and other_peers == frozenset()


def test_silent_peers_are_the_present_ones_not_heard_for_the_bound():
    silent = SilentPeers(stale_after_s=5.0)
    silent.heard(NodeId("early"), 0.0)  # a beacon before its presence: nothing to track
    silent.present(NodeId("a"), 0.0)
    silent.present(NodeId("b"), 0.0)
    silent.heard(NodeId("a"), 4.0)
    assert silent.silent(4.5) == frozenset()
    assert silent.silent(5.5) == {"b"}
    silent.gone(NodeId("b"))
    assert silent.silent(9.5) == {"a"}
    silent.present(NodeId("a"), 10.0)  # present again: its last beacon still counts
    assert silent.silent(10.0) == {"a"}
    with pytest.raises(ValueError, match="three intervals"):
        BeaconConfig(interval_s=1.0, stale_after_s=2.0)


def test_a_present_peer_that_falls_silent_makes_the_session_reopen(caplog):
    """a stops hearing b's beacons while b stays present, as over a one-sided link: a reopens
    its session once, keeps b as a peer throughout, and the two talk again afterwards."""
    caplog.set_level(logging.INFO, logger="shoal.cluster")
    port_a, port_b = _free_port(), _free_port()
    quick = BeaconConfig(interval_s=0.1, stale_after_s=1.5, settle_s=2.0)

    async def main():
        a = await ZenohTransport.open("node-a", dataclasses.replace(_config(port_a),
                                                                    beacons=quick))
        b = await ZenohTransport.open("node-b", _config(port_b, connect=(port_a,)))
        try:
            got: list = []
            peer_sets: list = []
            a.on_peers_changed(peer_sets.append)
            b.subscribe(Topic.GLOBAL_EVENTS, got.append)
            await wait_until(lambda: a.peers == {"node-b"} and b.peers == {"node-a"},
                             what="peers discovered")
            a._beacons.undeclare()  # b's beacons no longer reach a; b stays present
            await wait_until(lambda: a.reopened == 1, timeout=10, what="a's session reopened")
            reopened_at = time.monotonic()

            def heard() -> bool:  # b re-dials a's new session: repeat until it hears
                a.publish(Topic.GLOBAL_EVENTS, {"after": "reopen"})
                return bool(got)
            await wait_until(heard, timeout=10, what="b hears a on its new session")
            # Past the settle: b, announced again, is still a peer, and all is quiet.
            await asyncio.sleep(max(0.0, reopened_at + quick.settle_s + 0.5 - time.monotonic()))
            return peer_sets, a.peers, a.reopened
        finally:
            for transport in (a, b):
                await transport.close()

    peer_sets, peers, reopened = asyncio.run(main())
    assert all(peers == {"node-b"} for peers in peer_sets), peer_sets  # never reported gone
    assert peers == {"node-b"} and reopened == 1
    assert "reopening this node's cluster session" in caplog.text
