"""Three in-process nodes on the in-memory transport, each with a pool of in-memory runners:
models placed on first use and served to other nodes, placed instances started and torn
down, requests served across nodes with their chunks streamed back, cancellation, and a
serving node vanishing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from cluster_waits import wait_until
from memory_pool import generate, loaded, make_pool, sources  # noqa: F401
from state_builders import GIB, facts

from shoal.cluster.control_plane import ClusterConfig, ControlPlane
from shoal.cluster.election import ElectionConfig
from shoal.cluster.events import InstanceCreated
from shoal.cluster.instances import PlacementRequest
from shoal.cluster.master import MasterConfig
from shoal.cluster.replica import ReplicaConfig
from shoal.cluster.service import ClusterService, ServiceConfig
from shoal.cluster.telemetry import NodeReading, TelemetryConfig
from shoal.cluster.transport import MemoryHub
from shoal.cluster.worker_driver import WorkerConfig
from shoal.ids import NodeId
from shoal.pool.queue import AdmissionQueue, QueueLimits
from shoal.router import Router

CONFIG = dict(election=ElectionConfig(campaign_s=0.1, heartbeat_s=0.03, master_timeout_s=0.3),
              telemetry=TelemetryConfig(interval_s=0.03, timeout_s=0.2),
              replica=ReplicaConfig(sync_timeout_s=0.1),
              master=MasterConfig(settle_grace_s=0.3, reconcile_s=0.02))
SERVICE = ServiceConfig(accept_timeout_s=2.0, resend_s=0.2, silence_timeout_s=2.0,
                        peer_gone_s=0.2, place_timeout_s=2.0,
                        worker=WorkerConfig(tick_s=0.05, resend_s=0.2))


class Node:
    """memory: what telemetry reports; usable: what the worker finds free at load time."""

    def __init__(self, hub: MemoryHub, name: str, tmp: Path, model_sources,
                 memory: int = 64 * GIB, usable: int = 64 * GIB,
                 queue: QueueLimits | None = None, config: dict | None = None) -> None:
        self.name = NodeId(name)
        self.events: list = []
        transport = hub.connect(name)
        plane = ControlPlane(transport, ClusterConfig(event_log_dir=tmp / name,
                                                      **(config or CONFIG)),
                             lambda: NodeReading(node_id=self.name, taken_at=time.time(),
                                                 name=name, memory_total=memory,
                                                 memory_available=memory))
        pool = make_pool(model_sources, self.events, queue=AdmissionQueue(queue))
        self.service = ClusterService(plane, pool, lambda _backend: usable, SERVICE)
        self.router = Router(pool, self.service,
                             read_facts=lambda source: facts(model=source.model_id,
                                                             weight_bytes=GIB, n_layers=4))

    @property
    def state(self):
        return self.service.state

    async def stop(self) -> None:
        await self.service.stop()
        await self.router.shutdown()


async def start_cluster(tmp: Path, model_sources, names=("a", "b", "c"),
                        **node_options: dict) -> dict[str, Node]:
    """node_options: per node name, keyword arguments of Node (memory, usable, queue,
    config)."""
    hub = MemoryHub()
    nodes = {name: Node(hub, name, tmp, model_sources, **node_options.get(name, {}))
             for name in names}
    for node in nodes.values():
        await node.service.start()
    await wait_until(lambda: all(len(n.state.nodes) == len(names) and n.service.ready
                                 for n in nodes.values()), what="cluster formed")
    nodes["hub"] = hub  # type: ignore[assignment]
    return nodes


async def stop_cluster(nodes: dict) -> None:
    for name, node in nodes.items():
        if name != "hub":
            await node.stop()


async def collect(stream) -> list:
    return [chunk async for chunk in stream]


def statuses(node: Node, model: str) -> list[tuple[str, str, str]]:
    state = node.state
    return [(i.request.on_demand, i.ranks[0].node_id, state.instance_status(i.instance_id))
            for i in state.instances_of(model)]


def test_a_model_loaded_on_one_node_is_served_to_the_others(tmp_path, sources):  # noqa: F811
    async def main():
        nodes = await start_cluster(tmp_path, sources)
        a, c = nodes["a"], nodes["c"]
        try:
            await c.router.preload(["chat"])
            await wait_until(lambda: statuses(a, "chat") == [(True, "c", "ready")],
                             what="chat placed on c and ready")
            chunks = [chunk async for chunk in a.router.submit(generate("chat", "tokens:5:0"))]
            served_by_a = loaded(a.router)
            instance = a.state.instances_of("chat")[0]
            c.router.pool.unload(instance.instance_id)
            await wait_until(lambda: not a.state.instances, what="instance deleted")
            await wait_until(lambda: not a.state.tasks, what="task finished")
            return chunks, served_by_a, loaded(c.router)
        finally:
            await stop_cluster(nodes)

    chunks, served_by_a, left_on_c = asyncio.run(main())
    assert [c.kind for c in chunks] == ["accepted"] + ["token"] * 5 + ["finish"]
    assert "".join(c.text for c in chunks if c.kind == "token") == "t0 t1 t2 t3 t4 "
    assert served_by_a == []  # node a never loaded the model
    assert left_on_c == []


def test_a_request_for_a_model_no_node_serves_places_it_on_the_asking_node(
        tmp_path, sources):  # noqa: F811
    async def main():
        nodes = await start_cluster(tmp_path, sources)
        a, b = nodes["a"], nodes["b"]
        try:
            answers = await asyncio.gather(*(
                collect(b.router.submit(generate("chat", f"tokens:2:0.00{i}")))
                for i in range(4)))
            unknown = await collect(b.router.submit(generate("nowhere")))
            return answers, statuses(a, "chat"), b.events, unknown
        finally:
            await stop_cluster(nodes)

    answers, placed, events_b, unknown = asyncio.run(main())
    assert all([c.kind for c in chunks][-1] == "finish" for chunks in answers)
    assert placed == [(True, "b", "ready")]  # one placement for four concurrent requests
    assert events_b.count(("start", "chat")) == 1
    assert unknown[0].code == "model_not_found"


def test_requests_from_other_nodes_wait_their_turn_in_the_serving_node_s_queue(
        tmp_path, sources):  # noqa: F811
    async def main():
        # c serves one request at a time with one waiting; b's own queue would let all in.
        nodes = await start_cluster(tmp_path, sources,
                                    c=dict(queue=QueueLimits(parallel=1, max_queue=1)))
        b, c = nodes["b"], nodes["c"]
        try:
            await c.router.preload(["chat"])
            await wait_until(lambda: statuses(b, "chat") == [(True, "c", "ready")])
            seen: list[tuple[int, int]] = []

            async def watch() -> None:
                while True:
                    seen.append((c.router.queue.running("chat"), c.router.queue.depth("chat")))
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            answers = []
            queue = c.router.queue
            arrived = [lambda: queue.running("chat") == 1, lambda: queue.depth("chat") == 1,
                       lambda: True]
            for i in range(3):  # one after another: the first runs, the second waits
                answers.append(asyncio.create_task(
                    collect(b.router.submit(generate("chat", f"tokens:20:0.05{i}")))))
                await wait_until(arrived[i], what=f"request {i} at c")
            answers = await asyncio.gather(*answers)
            watcher.cancel()
            return answers, seen
        finally:
            await stop_cluster(nodes)

    answers, seen = asyncio.run(main())
    ends = [chunks[-1] for chunks in answers]
    assert [e.kind for e in ends] == ["finish", "finish", "error"]
    assert ends[2].code == "overloaded" and "--max-queue 1" in ends[2].message
    assert ends[2].retry_after_s is not None and ends[2].retry_after_s >= 1
    assert max(running for running, _ in seen) == 1  # never two at once on c
    assert max(waiting for _, waiting in seen) == 1


def test_a_placed_instance_is_hosted_then_torn_down_on_delete(tmp_path, sources):  # noqa: F811
    async def main():
        nodes = await start_cluster(tmp_path, sources)
        a, b, c = nodes["a"], nodes["b"], nodes["c"]
        try:
            request = PlacementRequest(facts=facts(model="chat", weight_bytes=GIB, n_layers=4),
                                       excluded_nodes=(NodeId("a"), NodeId("b")))
            instance = await a.service.place(request)
            await wait_until(lambda: statuses(b, "chat") == [(False, "c", "ready")],
                             what="placed instance ready")
            hosted = loaded(c.router)
            answer = [chunk async for chunk in b.router.submit(generate("chat", "tokens:2:0"))]
            assert b.service.delete(instance.instance_id)
            await wait_until(lambda: loaded(c.router) == [], what="runner torn down")
            return instance.ranks[0].node_id, hosted, answer, a.service.delete("inst-none")
        finally:
            await stop_cluster(nodes)

    server, hosted, answer, deleted_unknown = asyncio.run(main())
    assert server == "c" and hosted == ["chat"]
    assert [c.kind for c in answer] == ["accepted", "token", "token", "finish"]
    assert deleted_unknown is False


def test_closing_a_remote_stream_cancels_its_task(tmp_path, sources):  # noqa: F811
    async def main():
        nodes = await start_cluster(tmp_path, sources)
        a, c = nodes["a"], nodes["c"]
        try:
            await c.router.preload(["chat"])
            await wait_until(lambda: statuses(a, "chat") == [(True, "c", "ready")])
            stream = a.router.submit(generate("chat", "tokens:500:0.01"))
            first = [await anext(stream) for _ in range(3)]
            await wait_until(lambda: bool(c.state.tasks), what="task visible")
            await stream.aclose()
            await wait_until(lambda: not c.state.tasks and not c.service.worker._forwarders,
                             what="task cancelled and forwarder gone")
            return first
        finally:
            await stop_cluster(nodes)

    first = asyncio.run(main())
    assert [c.kind for c in first] == ["accepted", "token", "token"]


def test_a_serving_node_that_vanishes_after_the_first_token_ends_the_stream_with_an_error(tmp_path, sources):  # noqa: F811
    async def main():
        nodes = await start_cluster(tmp_path, sources)
        a, b = nodes["a"], nodes["b"]  # c is the master; b serves
        try:
            await b.router.preload(["chat"])
            await wait_until(lambda: statuses(a, "chat") == [(True, "b", "ready")])
            stream = a.router.submit(generate("chat", "tokens:500:0.01"))
            assert (await anext(stream)).kind == "accepted"
            assert (await anext(stream)).kind == "token"  # past the first token: no retry
            nodes["hub"].drop(NodeId("b"))
            started = time.monotonic()
            chunks = [chunk async for chunk in stream]
            waited = time.monotonic() - started
            await wait_until(lambda: not a.state.instances, what="lost instance removed")
            return chunks[-1], waited
        finally:
            await stop_cluster(nodes)

    last, waited = asyncio.run(main())
    assert last.kind == "error" and last.code == "unavailable"
    assert "node b" in last.message
    assert waited < SERVICE.silence_timeout_s  # its absence was noticed, not its silence


def test_a_node_that_cannot_fit_its_share_refuses_and_the_master_widens(tmp_path, sources):  # noqa: F811
    async def main():
        # c reports the most memory, so it is chosen, but finds none free when it loads.
        nodes = await start_cluster(tmp_path, sources, c={"memory": 64 * GIB, "usable": 0},
                                    a={"memory": 32 * GIB}, b={"memory": 32 * GIB})
        a = nodes["a"]
        try:
            await a.service.place(PlacementRequest(facts=facts(model="chat", weight_bytes=GIB,
                                                               n_layers=4)))
            created = lambda: [e.event.instance for e in a.service.recent
                               if isinstance(e.event, InstanceCreated)]
            await wait_until(lambda: len(created()) >= 2 and not a.state.instances, timeout=10,
                             what="placements ended")
            await asyncio.sleep(0.3)
            return created(), dict(a.state.instances), loaded(nodes["c"].router)
        finally:
            await stop_cluster(nodes)

    created, instances, loaded_on_c = asyncio.run(main())
    assert [len(i.ranks) for i in created[:2]] == [1, 2]  # refused, so one node wider
    assert created[1].rendezvous is not None and created[1].ranks[0].node_id == "c"
    assert all(len(i.ranks) <= 3 for i in created)  # bounded by the cluster's size
    assert len(created) <= 2 + 3 * 2  # and by the re-placement attempts
    assert instances == {} and loaded_on_c == []


def test_get_cluster_names_a_present_master_or_none_while_electing(tmp_path, sources):  # noqa: F811
    async def main():
        nodes = await start_cluster(tmp_path, sources)
        a = nodes["a"]  # c is the master
        try:
            assert a.service.describe()["master_id"] == "c"
            nodes["hub"].drop(NodeId("c"))
            seen = []
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                described = a.service.describe()
                seen.append((described["master_id"],
                             {node["node_id"] for node in described["nodes"]}))
                if described["master_id"] is not None and seen[0][0] is None:
                    break
                await asyncio.sleep(0.005)
            return seen
        finally:
            await stop_cluster(nodes)

    seen = asyncio.run(main())
    assert all(master is None or master in present for master, present in seen), seen
    assert seen[0][0] is None  # the dead master is not named while the election runs
    assert seen[-1][0] == "b"


def test_a_request_whose_serving_node_vanishes_before_its_first_token_is_retried_unseen(
        tmp_path, sources):  # noqa: F811
    async def main():
        nodes = await start_cluster(tmp_path, sources)
        a = nodes["a"]  # c is the master; chat runs on b and on c
        try:
            for other in ("b", "c"):
                await a.service.place(PlacementRequest(
                    facts=facts(model="chat", weight_bytes=GIB, n_layers=4),
                    excluded_nodes=(NodeId("a"), NodeId(other))))
            await wait_until(lambda: sorted(statuses(a, "chat")) == [
                (False, "b", "ready"), (False, "c", "ready")], what="two instances ready")
            stream = a.router.submit(generate("chat", "tokens:3:0.5"))
            assert (await anext(stream)).kind == "accepted"
            [task] = a.state.tasks.values()
            server = a.state.instances[task.instance_id].ranks[0].node_id
            nodes["hub"].drop(server)
            started = time.monotonic()
            rest = [chunk async for chunk in stream]
            survivor = nodes["c" if server == "b" else "b"]
            served = [rid for s in survivor.router.pool.registry.supervisors
                      for rid in s.submitted]
            return rest, time.monotonic() - started, served
        finally:
            await stop_cluster(nodes)

    rest, waited, served_by_survivor = asyncio.run(main())
    assert [c.kind for c in rest] == ["token", "token", "token", "finish"]
    assert served_by_survivor == ["g-tokens:3:0.5~retry"]
    assert waited < SERVICE.silence_timeout_s + 2.0


def test_a_task_failed_unheard_while_its_owner_followed_another_master_ends_its_stream(
        tmp_path, sources):  # noqa: F811
    """e is the master; a's request streams from b. e dies while a hears nothing from d, the
    next master, whose new session fails every task in flight: a catches up through a state
    sync, whose skipped events reach no callback. Its stream ends at the sync, with an error
    the router may retry, not at its silence bound."""
    async def main():
        nodes = await start_cluster(tmp_path, sources, names=("a", "b", "c", "d", "e"))
        a, b, hub = nodes["a"], nodes["b"], nodes["hub"]
        try:
            await b.router.preload(["chat"])
            await wait_until(lambda: statuses(a, "chat") == [(True, "b", "ready")])
            stream = a.router.submit(generate("chat", "tokens:500:0.01"))
            assert [(await anext(stream)).kind for _ in range(2)] == ["accepted", "token"]
            hub.mute(NodeId("a"), NodeId("d"))
            hub.drop(NodeId("e"))
            await wait_until(lambda: b.state.session_master == "d" and not b.state.tasks,
                             timeout=5, what="d's session failed the task")
            hub.heal()
            healed = time.monotonic()
            last = [chunk async for chunk in stream][-1]
            return last, time.monotonic() - healed
        finally:
            await stop_cluster(nodes)

    last, waited = asyncio.run(main())
    assert last.kind == "error" and last.code == "unavailable", last
    assert "the cluster master changed (now d)" in last.message
    assert waited < SERVICE.silence_timeout_s
