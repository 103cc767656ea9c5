"""A 2|1 partition of three in-process nodes (in-memory transport) that then heals: only the
side holding a quorum has a master that writes, the minority's requests end at once with a
clear error, and after healing one master, one session and one state remain."""

from __future__ import annotations

import asyncio
import time

from cluster_waits import wait_until
from memory_pool import generate, sources  # noqa: F401
from state_builders import GIB, facts
from test_service import CONFIG, start_cluster, stop_cluster

from shoal.cluster.election import ElectionConfig
from shoal.cluster.instances import PlacementRequest
from shoal.cluster.telemetry import TelemetryConfig
from shoal.ids import NodeId


# Slower than the other in-process tests' beat: on a busy host a telemetry reading may come
# late, and a node declared silent would muddle what this test watches.
PATIENT = {**CONFIG, "election": ElectionConfig(campaign_s=0.1, heartbeat_s=0.05,
                                                master_timeout_s=0.5),
           "telemetry": TelemetryConfig(interval_s=0.1, timeout_s=2.0)}


def writers(nodes: dict) -> set[str]:
    """The nodes whose master role may index events now."""
    return {name for name, node in nodes.items() if name != "hub"
            and (master := node.service.plane.master) is not None and master.holds_quorum()}


async def place(node, model: str, *excluded: str) -> None:
    await node.service.place(PlacementRequest(
        facts=facts(model=model, weight_bytes=GIB, n_layers=4),
        excluded_nodes=tuple(NodeId(n) for n in excluded)))


def test_a_partition_2_1_that_heals_keeps_one_writing_master_and_one_state(
        tmp_path, sources):  # noqa: F811
    async def main():
        nodes = await start_cluster(tmp_path, sources,
                                    **{name: {"config": PATIENT} for name in "abc"})
        a, b, c = nodes["a"], nodes["b"], nodes["c"]  # c is the master
        seen_writers: list[set[str]] = []
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                seen_writers.append(writers(nodes))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        try:
            await place(a, "chat", "b", "c")
            await wait_until(lambda: [i.ranks[0].node_id for i in a.state.instances.values()]
                             == ["a"], what="chat placed on a")
            before = dict(a.state.instances)
            nodes["hub"].partition({a.name, b.name}, {c.name})
            # The minority (with the old master) refuses at once, and never hangs.
            started = time.monotonic()
            refused = [chunk async for chunk in c.router.submit(generate("other"))]
            refused_in = time.monotonic() - started
            minority_idx = c.state.last_event_idx
            # The majority elects its own master and goes on writing.
            await wait_until(lambda: a.service.master_id == "b" and a.service.ready,
                             what="the majority's master")
            answer = [chunk async for chunk in a.router.submit(generate("other", "tokens:2:0"))]
            await asyncio.sleep(0.5)
            minority_wrote = c.state.last_event_idx != minority_idx
            nodes["hub"].heal()
            await wait_until(lambda: all(n.service.master_id == "b" for n in (a, b, c))
                             and all(n.state == b.state for n in (a, c))
                             and len(b.state.nodes) == 3, timeout=10,
                             what="one master and one state after healing")
            after = dict(b.state.instances)
            sessions = {n.service.plane.replica.session for n in (a, b, c)}
            return (refused, refused_in, minority_wrote, answer, before, after, sessions,
                    seen_writers)
        finally:
            stop.set()
            await watcher
            await stop_cluster(nodes)

    (refused, refused_in, minority_wrote, answer, before, after, sessions,
     seen_writers) = asyncio.run(main())
    assert all(len(now) <= 1 for now in seen_writers)  # never two masters writing
    assert {"c"} in seen_writers and {"b"} in seen_writers
    assert refused[-1].kind == "error" and refused[-1].code == "unavailable"
    assert "reaches 1 of the cluster's 3 nodes" in refused[-1].message
    assert refused_in < 1.0
    assert not minority_wrote
    assert answer[-1].kind == "finish", answer[-1]
    assert len(sessions) == 1
    models = sorted(i.model for i in after.values())
    assert models == ["chat", "other"]  # none lost, none doubled
    assert set(before) <= set(after)  # the majority's instance survived as it was


def test_a_master_that_shuts_down_leaves_so_the_other_of_two_masters_alone(
        tmp_path, sources):  # noqa: F811
    """Two nodes hold no quorum without the master, so it says it leaves as it shuts down:
    the other then masters alone and places models, instead of waiting for it to return."""
    async def main():
        nodes = await start_cluster(tmp_path, sources, names=("a", "b"),
                                    **{name: {"config": PATIENT} for name in "ab"})
        a, b = nodes["a"], nodes["b"]
        try:
            assert a.service.master_id == "b"  # the higher id
            await b.stop()
            await wait_until(lambda: a.service.master_id == "a" and a.service.ready
                             and set(a.state.nodes) == {"a"}, what="a mastering alone")
            await place(a, "chat")
            await wait_until(lambda: [i.model for i in a.state.instances.values()] == ["chat"],
                             what="chat placed by the survivor")
            return a.service.plane.has_quorum()
        finally:
            await a.stop()

    assert asyncio.run(main())


def test_links_that_are_not_transitive_never_make_two_masters_write(tmp_path, sources):  # noqa: F811
    """c (the master) and b stop hearing each other while both still hear a and count each
    other present: b's own campaign elects b, but a follows c, so b counts no majority and
    takes no master role; once the link mends, c is the only master and all states agree."""
    async def main():
        nodes = await start_cluster(tmp_path, sources,
                                    **{name: {"config": PATIENT} for name in "abc"})
        a, b, c = nodes["a"], nodes["b"], nodes["c"]
        seen_writers: list[set[str]] = []
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                seen_writers.append(writers(nodes))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        try:
            nodes["hub"].mute(NodeId("b"), NodeId("c"))
            await wait_until(lambda: b.service.plane.election.master == "b", timeout=5,
                             what="b elects itself")
            await asyncio.sleep(1.0)  # b's chance to take a master role it must not take
            b_may_write = b.service.plane.has_quorum()
            nodes["hub"].heal()
            await wait_until(lambda: all(n.service.master_id == "c" for n in (a, b, c))
                             and all(n.state == c.state for n in (a, b)), timeout=10,
                             what="one master and one state after the link mends")
            return seen_writers, b_may_write
        finally:
            stop.set()
            await watcher
            await stop_cluster(nodes)

    seen_writers, b_may_write = asyncio.run(main())
    assert all(now <= {"c"} for now in seen_writers), {frozenset(w) for w in seen_writers}
    assert not b_may_write
