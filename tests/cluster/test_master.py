"""Master and replicas over the in-memory transport: indexing, sync, failover seeding."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from cluster_waits import wait_until
from state_builders import GIB, facts, runner_status

from shoal.cluster.apply import apply_all
from shoal.cluster.control_plane import ClusterConfig, ControlPlane
from shoal.cluster.election import ElectionConfig
from shoal.cluster.event_log import EventLog
from shoal.cluster.events import (
    CancelTask,
    DeleteInstance,
    IndexedEvent,
    InstanceDeleted,
    NodeJoined,
    NodeLeft,
    PlaceInstance,
    RefusePlacement,
    RunnerStatusChanged,
    SessionStarted,
    SubmitTask,
    TaskFailed,
    to_wire,
)
from shoal.cluster.instances import PlacementRequest
from shoal.cluster.master import Master, MasterConfig
from shoal.cluster.replica import Replica, ReplicaConfig
from shoal.cluster.state import ClusterState, NodeInfo
from shoal.cluster.telemetry import NodeReading, Telemetry, TelemetryConfig
from shoal.cluster.transport import MemoryHub, Topic
from shoal.ids import CommandId, InstanceId, NodeId
from shoal.protocol import GenerationRequest

TELEMETRY = TelemetryConfig(interval_s=0.03, timeout_s=0.2)
SYNC = ReplicaConfig(sync_timeout_s=0.1)


class Node:
    """One in-process node: transport, telemetry, replica, and a master when elected."""

    def __init__(self, hub: MemoryHub, name: str, tmp: Path, memory: int = 64 * GIB) -> None:
        self.name = NodeId(name)
        self.transport = hub.connect(name)
        self.telemetry = Telemetry(self.transport, TELEMETRY, read=lambda: NodeReading(
            node_id=self.name, taken_at=time.time(), name=name, addresses=(f"{name}:8470",),
            memory_total=memory, memory_available=memory))
        self.replica = Replica(self.transport, SYNC)
        self.seen: list[IndexedEvent] = []
        self.replica.on_event(self.seen.append)
        self.log_dir = tmp / name / "events"
        self.master: Master | None = None
        self.event_log: EventLog | None = None

    async def start(self) -> Node:
        await self.telemetry.start()
        await self.replica.start()
        return self

    async def become_master(self, config: MasterConfig, seed=None) -> Master:
        self.event_log = EventLog(self.log_dir)
        self.master = Master(self.transport, self.telemetry.table, self.event_log, config,
                             seed=seed)
        await self.master.start()
        return self.master

    async def stop(self) -> None:
        if self.master is not None:
            await self.master.stop()
        await self.replica.stop()
        await self.telemetry.stop()

    def command(self, command) -> None:
        self.transport.publish(Topic.COMMANDS, to_wire(command))


def _request(request_id: str, model: str = "tiny") -> GenerationRequest:
    return GenerationRequest(request_id=request_id, model=model, prompt="hi")


def _kinds(events) -> list[str]:
    return [indexed.event.kind for indexed in events]


async def _stop_all(nodes) -> None:
    for node in nodes:
        await node.stop()


def test_commands_become_contiguous_logged_events(tmp_path):
    async def main():
        hub = MemoryHub()
        a, b = [await Node(hub, n, tmp_path).start() for n in ("a", "b")]
        try:
            master = await a.become_master(MasterConfig(settle_grace_s=60, reconcile_s=0.02))
            await wait_until(lambda: set(b.replica.state.nodes) == {"a", "b"}, what="admitted")
            b.command(PlaceInstance(command_id=CommandId("c1"),
                                    request=PlacementRequest(facts=facts())))
            await wait_until(lambda: b.replica.state.instances, what="placed")
            instance = next(iter(b.replica.state.instances.values()))
            b.command(SubmitTask(command_id=CommandId("c2"), instance_id=instance.instance_id,
                                 owner_node=b.name, request=_request("r1")))
            b.command(SubmitTask(command_id=CommandId("c3"), instance_id=InstanceId("nope"),
                                 owner_node=b.name, request=_request("r2")))
            b.transport.publish(Topic.COMMANDS, {"kind": "place_instance"})  # malformed
            b.command(CancelTask(command_id=CommandId("c4"), task_id="r1"))
            b.transport.publish(Topic.LOCAL_EVENTS, to_wire(RunnerStatusChanged(
                status=runner_status(instance, 0, "ready"))))
            b.command(DeleteInstance(command_id=CommandId("c5"),
                                     instance_id=instance.instance_id))
            await wait_until(lambda: not b.replica.state.instances and b.seen[-1].idx
                             == master.state.last_event_idx, what="deleted")
            logged = list(a.event_log.read())  # read back from disk
            response = master.sync_response(NodeId("x"))
            assert response.snapshot == ClusterState() and list(response.tail) == logged
            return master.state, a.replica.state, b.replica.state, b.seen, logged
        finally:
            await _stop_all((a, b))

    master_state, a_state, b_state, seen, logged = asyncio.run(main())
    assert master_state == a_state == b_state
    assert [e.idx for e in seen] == list(range(len(seen)))
    assert logged == seen
    kinds = _kinds(seen)
    assert kinds[0] == "session_started"
    assert kinds[kinds.index("instance_created"):] == [
        "instance_created", "task_created", "task_failed", "task_cancelled",
        "runner_status_changed", "task_failed", "instance_deleted"]
    missing = seen[kinds.index("task_failed")].event
    assert missing.task_id == "r2" and "does not exist" in missing.message
    unloaded = seen[len(kinds) - 2].event
    assert unloaded.task_id == "r1" and "unloaded" in unloaded.message
    assert b_state.tasks == {} and b_state.runners == {}


def test_late_joiner_and_a_replica_behind_a_gap_sync(tmp_path):
    async def main():
        hub = MemoryHub()
        a, b = [await Node(hub, n, tmp_path).start() for n in ("a", "b")]
        late = None
        try:
            master = await a.become_master(MasterConfig(settle_grace_s=60, reconcile_s=0.02,
                                                        snapshot_every=3))
            await wait_until(lambda: len(b.replica.state.nodes) == 2)
            hub.partition({a.name}, {b.name})  # b misses what follows
            for i in range(5):
                a.command(PlaceInstance(command_id=CommandId(f"p{i}"), request=PlacementRequest(
                    facts=facts(model=f"m{i}", weight_bytes=GIB))))
            await wait_until(lambda: len(master.state.instances) == 5)
            hub.heal()
            a.command(PlaceInstance(command_id=CommandId("p5"), request=PlacementRequest(
                facts=facts(model="m5", weight_bytes=GIB))))
            # The next event shows b a gap; it buffers it and syncs.
            await wait_until(lambda: b.replica.state == master.state, what="b caught up")
            late = await Node(hub, "c", tmp_path).start()
            await wait_until(lambda: late.replica.in_sync
                             and late.replica.state.instances == master.state.instances,
                             what="late joiner synced")
            response = master.sync_response(NodeId("x"))
            return master.state, b.replica, late.replica, response
        finally:
            await _stop_all([n for n in (a, b, late) if n is not None])

    state, b_replica, late_replica, response = asyncio.run(main())
    assert len(state.instances) == 6 and b_replica.session == late_replica.session
    # The answer is a recent snapshot plus a short tail read back from the log.
    assert apply_all(response.snapshot, response.tail) == state
    assert response.snapshot.last_event_idx >= state.last_event_idx - 2
    assert len(response.tail) < 3


def test_sync_answer_comes_from_memory_when_the_log_is_degraded(tmp_path):
    def failing_opener(path, mode):
        raise OSError(28, "No space left on device")

    async def main():
        hub = MemoryHub()
        a = await Node(hub, "a", tmp_path).start()
        try:
            master = Master(a.transport, a.telemetry.table,
                            EventLog(tmp_path / "log", opener=failing_opener),
                            MasterConfig(settle_grace_s=60, reconcile_s=0.02))
            await master.start()
            await wait_until(lambda: master.state.nodes)
            response = master.sync_response(NodeId("x"))
            await master.stop()
            return master.state, response
        finally:
            await a.stop()

    state, response = asyncio.run(main())
    assert response.snapshot == state and response.tail == ()


def test_failover_seeds_the_new_session_and_prunes_the_departed_master_at_once(tmp_path):
    grace = 5.0  # for silent nodes; the dead master's presence is gone, so no wait

    async def main():
        hub = MemoryHub()
        a, b, c = [await Node(hub, n, tmp_path, memory=m).start()
                   for n, m in (("a", 64 * GIB), ("b", 48 * GIB), ("c", 32 * GIB))]
        try:
            old = await a.become_master(MasterConfig(settle_grace_s=0, reconcile_s=0.02))
            await wait_until(lambda: len(c.replica.state.nodes) == 3, what="admitted")
            for i in range(2):  # the first lands on a (most memory), the second on b
                a.command(PlaceInstance(command_id=CommandId(f"p{i}"), request=PlacementRequest(
                    facts=facts(model=f"m{i}", weight_bytes=20 * GIB),
                    excluded_nodes=(NodeId("a"),) if i else ())))
            await wait_until(lambda: len(b.replica.state.instances) == 2, what="placed")
            on_b = next(i for i in b.replica.state.instances.values() if i.node_ids == ("b",))
            a.command(SubmitTask(command_id=CommandId("s1"), instance_id=on_b.instance_id,
                                 owner_node=c.name, request=_request("r1", model="m1")))
            a.transport.publish(Topic.LOCAL_EVENTS, to_wire(RunnerStatusChanged(
                status=runner_status(on_b, 0, "ready"))))
            await wait_until(lambda: b.replica.state.tasks and b.replica.state.runners)
            old_session = b.replica.session

            await old.stop()
            hub.drop(a.name)  # the master dies
            await a.telemetry.stop()
            for node in (b, c):
                node.replica.follow(b.name)
            started = time.monotonic()
            new = await b.become_master(MasterConfig(settle_grace_s=grace, reconcile_s=0.02),
                                        seed=b.replica.state)
            await wait_until(lambda: c.replica.session == new.session, what="c follows b")
            await wait_until(lambda: any(i.model == "m0" and i.node_ids != ("a",)
                                         for i in c.replica.state.instances.values()),
                             timeout=grace, what="m0 re-placed")
            pruned_after = time.monotonic() - started
            return old_session, on_b, new, c.seen, c.replica.state, pruned_after
        finally:
            await _stop_all((b, c))

    old_session, on_b, new, seen, state, pruned_after = asyncio.run(main())
    assert new.session != old_session
    session = [e for e in seen if e.idx == 0 and isinstance(e.event, SessionStarted)][-1]
    start = seen.index(session)
    first = session.event
    assert first.master_id == "b"
    assert {i.model for i in first.instances} == {"m0", "m1"}  # instances survive
    failed = seen[start + 1].event
    assert isinstance(failed, TaskFailed) and failed.task_id == "r1"
    assert "master changed" in failed.message
    # a's presence is gone, so the settle grace (for silent nodes) does not hold it: a
    # leaves at once and m0 is re-placed on a live node, while m1 on b is untouched.
    assert pruned_after < grace
    later = [e.event for e in seen[start:]]
    assert any(isinstance(e, NodeLeft) and e.node_id == "a" and e.reason == "disconnected"
               for e in later)
    assert any(isinstance(e, InstanceDeleted) and "left the cluster" in e.reason for e in later)
    assert on_b.instance_id in state.instances
    assert state.runners == {} and state.tasks == {}  # rebuilt by workers, not carried
    assert set(state.nodes) == {"b", "c"}


def test_refused_placement_is_replaced_one_node_wider(tmp_path):
    async def main():
        hub = MemoryHub()
        a, b = [await Node(hub, n, tmp_path, memory=24 * GIB).start() for n in ("a", "b")]
        try:
            master = await a.become_master(MasterConfig(settle_grace_s=60, reconcile_s=0.02))
            await wait_until(lambda: len(master.state.nodes) == 2)
            a.command(PlaceInstance(command_id=CommandId("p"), request=PlacementRequest(
                facts=facts(weight_bytes=8 * GIB))))
            await wait_until(lambda: master.state.instances)
            single = next(iter(master.state.instances.values()))
            refusal = RefusePlacement(command_id=CommandId("r"), instance_id=single.instance_id,
                                      node_id=single.node_ids[0], reason="only 3 GiB free")
            a.command(refusal)
            a.command(refusal)  # repeated: a no-op
            await wait_until(lambda: single.instance_id not in master.state.instances
                             and master.state.instances, what="re-placed")
            await asyncio.sleep(0.05)
            return list(master.state.instances.values()), _kinds(a.seen)
        finally:
            await _stop_all((a, b))

    instances, kinds = asyncio.run(main())
    assert len(instances) == 1 and len(instances[0].ranks) == 2
    assert kinds.count("instance_deleted") == 1 and kinds.count("instance_created") == 2


def test_failed_placed_instances_are_placed_again_with_a_bound(tmp_path):
    async def main():
        hub = MemoryHub()
        a, b = [await Node(hub, n, tmp_path, memory=24 * GIB).start() for n in ("a", "b")]
        try:
            master = await a.become_master(MasterConfig(settle_grace_s=60, reconcile_s=0.02,
                                                        max_replacements=2))
            await wait_until(lambda: len(master.state.nodes) == 2)
            a.command(PlaceInstance(command_id=CommandId("p"), request=PlacementRequest(
                facts=facts(weight_bytes=8 * GIB), sharding="pipeline", min_nodes=2)))
            await wait_until(lambda: master.state.instances)
            attempts = []
            for _ in range(3):
                instance = next(iter(master.state.instances.values()))
                attempts.append((instance.attempt, instance.rendezvous))
                b.transport.publish(Topic.LOCAL_EVENTS, to_wire(RunnerStatusChanged(
                    status=runner_status(instance, 1, "failed", "group did not form"))))
                gone = instance.instance_id
                await wait_until(lambda gone=gone: gone not in master.state.instances)
                await asyncio.sleep(0.05)
            return attempts, master.state.instances, _kinds(a.seen)
        finally:
            await _stop_all((a, b))

    attempts, left, kinds = asyncio.run(main())
    assert [attempt for attempt, _ in attempts] == [0, 1, 2]
    assert all(r.host == "a" and 29500 <= r.port < 60000 for _, r in attempts)  # rank 0's node
    assert left == {}  # the third failure exceeded max_replacements
    assert kinds.count("instance_created") == 3 and kinds.count("instance_deleted") == 3


def test_replica_buffers_out_of_order_events(tmp_path):
    async def main():
        hub = MemoryHub()
        sender, node = hub.connect("m"), hub.connect("f")
        replica = Replica(node, ReplicaConfig(sync_timeout_s=5))
        requests = []
        sender.subscribe(Topic.STATE_SYNC, requests.append)
        await replica.start()
        session_started = SessionStarted(master_id=NodeId("m"))
        events = [session_started] + [NodeJoined(node=n) for n in _infos("x", "y", "z")]
        wire = [{"session": "s1", "master": "m", "indexed": to_wire(IndexedEvent(idx=i, event=e))}
                for i, e in enumerate(events)]
        for message in (wire[0], wire[2], wire[3], wire[2]):
            sender.publish(Topic.GLOBAL_EVENTS, message)
        await asyncio.sleep(0.02)
        held = (replica.state.last_event_idx, replica.in_sync, len(requests))
        sender.publish(Topic.GLOBAL_EVENTS, wire[1])
        await wait_until(lambda: replica.state.last_event_idx == 3)
        await replica.stop()
        return held, list(replica.state.nodes), replica.in_sync

    held, nodes, in_sync = asyncio.run(main())
    assert held == (0, False, 2)  # applied 0, held 2 and 3, asked once (plus at start)
    assert nodes == ["x", "y", "z"] and in_sync


def _infos(*names):
    return [NodeInfo(node_id=NodeId(n), name=n) for n in names]


def test_control_planes_elect_replicate_and_fail_over(tmp_path):
    config = dict(election=ElectionConfig(campaign_s=0.1, heartbeat_s=0.03, master_timeout_s=0.3),
                  telemetry=TELEMETRY, replica=SYNC,
                  master=MasterConfig(settle_grace_s=0.3, reconcile_s=0.02))

    def reader(name: str, memory: int):
        return lambda: NodeReading(node_id=NodeId(name), taken_at=time.time(), name=name,
                                   memory_total=memory, memory_available=memory)

    async def main():
        hub = MemoryHub()
        planes = {}
        for name, memory in (("n1", 64 * GIB), ("n2", 32 * GIB), ("n3", 32 * GIB)):
            planes[name] = ControlPlane(hub.connect(name), ClusterConfig(
                event_log_dir=tmp_path / name, **config), reader(name, memory))
            await planes[name].start()
        try:
            await wait_until(lambda: all(len(p.replica.state.nodes) == 3
                                         and p.replica.master == "n3"
                                         for p in planes.values()), what="cluster formed")
            planes["n2"].send_command(PlaceInstance(command_id=CommandId("p"),
                                                    request=PlacementRequest(facts=facts())))
            await wait_until(lambda: all(p.replica.state.instances for p in planes.values()))
            placed = dict(planes["n1"].replica.state.instances)
            old_session = planes["n1"].replica.session

            dead = planes.pop("n3")
            hub.drop(NodeId("n3"))
            await dead.stop()
            await wait_until(lambda: all(p.replica.master == "n2"
                                         and p.replica.session != old_session
                                         and set(p.replica.state.nodes) == {"n1", "n2"}
                                         for p in planes.values()),
                             what="failed over and pruned")
            return (placed, {name: p.replica.state for name, p in planes.items()},
                    planes["n2"].master is not None, planes["n1"].master is None)
        finally:
            for plane in planes.values():
                await plane.stop()

    placed, states, n2_leads, n1_follows = asyncio.run(main())
    assert n2_leads and n1_follows
    assert states["n1"] == states["n2"]
    assert states["n1"].instances == placed  # the instance on n1 survived the failover
    assert states["n1"].session_master == "n2"
