"""One node's control plane: telemetry, replica and election on a transport, plus the master
role while this node holds it.

The election decides; this class only follows it: the replica is told which master to
follow, and when this node wins it starts a Master seeded from the replica's state (so
instances survive a failover), and stops it when another node wins. The role is held only
with a quorum of the cluster's nodes in reach (quorum.py): a node cut off with a minority
steps down, and while it holds no role its election rank says so, so that after the
partition heals the majority's master stays master.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shoal.cluster.background import cancel_and_wait
from shoal.cluster.election import Election, ElectionConfig
from shoal.cluster.event_log import EventLog
from shoal.cluster.events import Command, WorkerEvent, to_wire
from shoal.cluster.master import Master, MasterConfig
from shoal.cluster.quorum import describe_quorum, holds_quorum
from shoal.cluster.replica import Replica, ReplicaConfig
from shoal.cluster.state import ClusterState
from shoal.cluster.telemetry import NodeReading, Telemetry, TelemetryConfig
from shoal.cluster.transport.base import Transport
from shoal.cluster.transport.topics import Topic
from shoal.ids import NodeId

log = logging.getLogger("shoal.cluster")


@dataclass(frozen=True)
class ClusterConfig:
    event_log_dir: Path
    election: ElectionConfig = field(default_factory=ElectionConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    master: MasterConfig = field(default_factory=MasterConfig)
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)


class ControlPlane:
    """start() joins the cluster, stop() leaves it; `master` is set while this node leads."""

    def __init__(self, transport: Transport, config: ClusterConfig,
                 read_telemetry: Callable[[], NodeReading]) -> None:
        self.transport = transport
        self.config = config
        self.node_id = transport.node_id
        self.telemetry = Telemetry(transport, config.telemetry, read=read_telemetry)
        self.replica = Replica(transport, config.replica)
        self.election = Election(transport, config.election,
                                 has_state=lambda: self.replica.session is not None,
                                 leads=lambda: self.master is not None)
        self.master: Master | None = None
        # (the elected master, whether this node may take the role on this news)
        self._wanted: asyncio.Queue[tuple[NodeId | None, bool]] = asyncio.Queue()
        self._roles: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.election.on_master_changed(self._on_master_changed)
        # Whether this node may hold the role is weighed again after every campaign (a
        # healed partition may restore its quorum), and, to step down only, on every change
        # of peers and every heartbeat: taking the role waits for a campaign's fresh
        # result, never a stale one.
        self.election.on_settled(lambda master: self._wanted.put_nowait((master, True)))
        self.transport.on_peers_changed(
            lambda _peers: self._wanted.put_nowait((self.election.master, False)))
        await self.telemetry.start()
        await self.replica.start()
        self._roles = asyncio.create_task(self._follow_roles(), name="cluster-roles")
        await self.election.start()

    async def stop(self) -> None:
        if self.master is not None:
            self.master.leave()  # sent before the transport closes (it flushes its queue)
        await self.election.stop()
        await cancel_and_wait([self._roles])
        self._roles = None
        await self._step_down()
        await self.replica.stop()
        await self.telemetry.stop()

    def send_command(self, command: Command) -> None:
        """Hand command to the master (wherever it runs)."""
        self.transport.publish(Topic.COMMANDS, to_wire(command))

    def send_worker_event(self, event: WorkerEvent) -> None:
        """Report a runner or task change for the master to index."""
        self.transport.publish(Topic.LOCAL_EVENTS, to_wire(event))

    def has_quorum(self) -> bool:
        """Whether this node reaches a quorum of the cluster's nodes (quorum.py): nodes
        present and heard in the election's last master timeout."""
        state = self._state()
        return holds_quorum(state.nodes, self._reachable(), state.session_master)

    def describe_quorum(self) -> str:
        return describe_quorum(self._state().nodes, self._reachable())

    def _reachable(self) -> frozenset[NodeId]:
        # Presence lags a cut link by Zenoh's lease (seconds); the election's messages,
        # every heartbeat from every node, do not.
        return self.election.reachable() & (self.transport.peers | {self.node_id})

    def _state(self) -> ClusterState:
        return self.master.state if self.master is not None else self.replica.state

    def _on_master_changed(self, master: NodeId | None) -> None:
        self.replica.follow(master)
        self._wanted.put_nowait((master, True))

    async def _follow_roles(self) -> None:
        """Start or stop the master role, one change at a time, skipping superseded ones."""
        while True:
            try:
                async with asyncio.timeout(self.config.election.heartbeat_s):
                    master, may_take = await self._wanted.get()
            except TimeoutError:
                master, may_take = self.election.master, False
            while not self._wanted.empty():
                master, later_may_take = self._wanted.get_nowait()
                may_take = may_take or later_may_take
            try:
                lead = master == self.node_id and self.has_quorum()
                if lead and self.master is None and may_take:
                    await self._take_over()
                elif not lead and self.master is not None:
                    if master == self.node_id:
                        log.warning("master %s steps down: %s", self.node_id,
                                    self.describe_quorum())
                    await self._step_down()
                elif master == self.node_id and self.master is None and may_take:
                    log.warning("node %s won the election but takes no master role: %s",
                                self.node_id, self.describe_quorum())
            except Exception:  # a failed switch must not end role-following for good
                log.exception("node %s could not switch its master role", self.node_id)

    async def _take_over(self) -> None:
        # Opening archives the previous live file (zstd): off the loop.
        event_log = await asyncio.to_thread(EventLog, self.config.event_log_dir)
        if self.election.master != self.node_id:
            # It heard a higher master while the log opened: starting a session now would
            # make two masters for a moment.
            event_log.close()
            return
        seed = self.replica.state if self.replica.session is not None else None
        master = Master(self.transport, self.telemetry.table, event_log, self.config.master,
                        seed=seed, reachable=self._reachable)
        await master.start()
        self.master = master

    async def _step_down(self) -> None:
        master, self.master = self.master, None
        if master is not None:
            log.info("node %s is no longer master", self.node_id)
            await master.stop()
