"""Bully election of the cluster master over the ELECTION topic.

A node's rank is (force_master, holds the master role now, has replicated state, node_id),
compared in that order (an elected node without the role, cut off from a quorum, ranks as
no master); the highest-ranked node that is connected wins. So at formation the highest id
wins, `--force-master` beats everyone, and a working master is not displaced by a node that
merely joins (which would also seed the new session from an empty state); after a failover,
nodes holding the replicated state come first.

A campaign broadcasts this node's candidacy for `campaign_s` and collects the others' (nodes
that are not campaigning answer once); the best connected candidate is the master. Every node
that sees the same candidates picks the same winner, and heartbeats settle the rest: a master
that hears a higher master steps down, a node that hears a master ranked below itself
campaigns (the "bully" step).

Every node speaks each heartbeat (a master its heartbeat, the others an "alive"), so each
knows which nodes it hears now (`reachable`), sooner than presence tokens tell of a cut link;
the control plane counts its quorum among them. Each message also names the master its
sender follows while that master leads and is heard (`leader`); a node that leads, or follows
a leader, other than this one's is not counted: where links are not transitive (A hears B and
C, B and C not each other), B and C would otherwise each count A into a majority, and two
masters whose campaigns missed each other's candidacies (messages held up for seconds) would
each count the other.

Campaigns start at start-up, when the connected-peer set has changed since the last
campaign, when the master falls silent for `master_timeout_s`, and when a lower-ranked node
campaigns or masters while this one would win. A running campaign always finishes; if the
peer set changed meanwhile another one follows. Re-reporting an unchanged peer set (flapping
links) never starts one, so connection churn cannot livelock formation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shoal.cluster.background import cancel_and_wait
from shoal.cluster.transport.base import Fanout, Subscription, Transport
from shoal.cluster.transport.topics import Topic
from shoal.ids import NodeId

log = logging.getLogger("shoal.cluster.election")

Rank = tuple[bool, bool, bool, str]
_NO_RANK: Rank = (False, False, False, "")
_CHANGED = "master"
_SETTLED = "settled"


@dataclass(frozen=True)
class ElectionConfig:
    # How long a campaign collects candidacies; it re-broadcasts three times meanwhile so a
    # peer whose subscription arrives late still hears it.
    campaign_s: float = 1.5
    heartbeat_s: float = 0.5
    # A follower that hears no heartbeat from its master for this long campaigns.
    master_timeout_s: float = 3.0
    force_master: bool = False

    def __post_init__(self) -> None:
        for name in ("campaign_s", "heartbeat_s", "master_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"election {name} must be positive")
        if self.master_timeout_s < 2 * self.heartbeat_s:
            raise ValueError("election master_timeout_s must be at least two heartbeats "
                             f"({2 * self.heartbeat_s:g}s)")

    @property
    def failover_bound_s(self) -> float:
        """Longest time from a master falling silent to followers having a new one."""
        return self.master_timeout_s + self.heartbeat_s + self.campaign_s


class Election:
    """This node's view of who the master is; start() joins, stop() leaves."""

    def __init__(self, transport: Transport, config: ElectionConfig | None = None,
                 has_state: Callable[[], bool] = lambda: False,
                 leads: Callable[[], bool] | None = None) -> None:
        """has_state: whether this node holds replicated cluster state (a replica in sync);
        leads: whether this node holds the master role now (None: whenever it is the
        election's master). An elected node without the role (no quorum) ranks as none."""
        self._transport = transport
        self.config = config or ElectionConfig()
        self.node_id = transport.node_id
        self._has_state = has_state
        self._leads = leads
        self._master: NodeId | None = None
        self._ranks: dict[NodeId, Rank] = {}
        self._heard: dict[NodeId, float] = {}  # when each node's last election message came
        self._leaders: dict[NodeId, NodeId | None] = {}  # the leader each node said it follows
        self._last_heartbeat = time.monotonic()
        self._candidates: dict[NodeId, Rank] | None = None  # None: no campaign running
        self._basis: frozenset[NodeId] | None = None  # peers when the last campaign began
        self._campaign: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._subscriptions: list[Subscription] = []
        self._callbacks = Fanout()
        self._settled = asyncio.Event()
        self.campaigns = 0  # campaigns completed, for logs and tests

    @property
    def rank(self) -> Rank:
        leads = self.is_master and (self._leads is None or self._leads())
        return (self.config.force_master, leads, self._has_state(), str(self.node_id))

    @property
    def master(self) -> NodeId | None:
        return self._master

    @property
    def is_master(self) -> bool:
        return self._master == self.node_id

    @property
    def campaigning(self) -> bool:
        return self._candidates is not None

    def reachable(self) -> frozenset[NodeId]:
        """This node and those heard within the master timeout (every node speaks each
        heartbeat: masters their heartbeat, the others that they are alive), less those
        that lead or follow a leader other than this node's (itself when it is the master
        or has none): two masters that each still hear the other, their campaigns having
        missed each other's candidacies, do not count each other into a majority."""
        now = time.monotonic()
        mine = self._master or self.node_id
        return frozenset(node for node, heard in self._heard.items()
                         if now - heard <= self.config.master_timeout_s
                         and self._leaders.get(node) in (None, mine)
                         and (node == mine or not self._ranks[node][1])) | {self.node_id}

    @property
    def leader(self) -> NodeId | None:
        """The master this node follows while that master leads (its heartbeats say it holds
        the role), is connected and is heard; None when this node is the master or has none."""
        master = self._master
        if master is None or master == self.node_id or self._master_silent():
            return None
        if master not in self._transport.peers or not self._ranks.get(master, _NO_RANK)[1]:
            return None
        return master

    def on_master_changed(self, callback: Callable[[NodeId | None], None]) -> Subscription:
        """callback(master) on the loop whenever the master this node follows changes."""
        return self._callbacks.add(_CHANGED, callback)

    def on_settled(self, callback: Callable[[NodeId], None]) -> Subscription:
        """callback(master) on the loop whenever a campaign ends, its winner unchanged or
        not (whether this node may take the role can have changed meanwhile)."""
        return self._callbacks.add(_SETTLED, callback)

    async def wait_for_master(self, timeout: float) -> NodeId:
        """The master once a campaign has settled; TimeoutError after timeout seconds."""
        try:
            async with asyncio.timeout(timeout):
                await self._settled.wait()
        except TimeoutError:
            raise TimeoutError(f"no master elected within {timeout:g}s") from None
        if self._master is None:  # lost again between the result and this wake-up
            raise TimeoutError(f"no master elected within {timeout:g}s")
        return self._master

    async def start(self) -> None:
        self._subscriptions = [
            self._transport.subscribe(Topic.ELECTION, self._on_message),
            self._transport.on_peers_changed(self._on_peers)]
        self._ticker = asyncio.create_task(self._tick(), name=f"election-tick-{self.node_id}")
        self._start_campaign("start-up")

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            subscription.close()
        self._subscriptions = []
        await cancel_and_wait((self._campaign, self._ticker))
        self._campaign = self._ticker = None
        self._candidates = None
        self._settled.clear()
        self._set_master(None)

    # --- campaigns -------------------------------------------------------------------------

    def _start_campaign(self, reason: str) -> None:
        if self._campaign is not None and not self._campaign.done():
            return  # the running campaign finishes first; _run_campaigns reruns on a change
        log.info("node %s campaigns: %s", self.node_id, reason)
        self._settled.clear()
        self._campaign = asyncio.create_task(self._run_campaigns(),
                                             name=f"election-campaign-{self.node_id}")

    async def _run_campaigns(self) -> None:
        while True:
            self._basis = self._transport.peers
            self._candidates = {self.node_id: self.rank}
            deadline = time.monotonic() + self.config.campaign_s
            while (remaining := deadline - time.monotonic()) > 0:
                self._publish("candidate", reply=False)
                await asyncio.sleep(min(remaining, self.config.campaign_s / 3))
            # Only candidates still connected count: one that died mid-campaign cannot lead.
            connected = self._transport.peers | {self.node_id}
            candidates = {node: rank for node, rank in self._candidates.items()
                          if node in connected}
            candidates[self.node_id] = self.rank
            self._candidates = None
            winner = max(candidates, key=lambda node: candidates[node])
            self.campaigns += 1
            log.info("node %s: campaign over, master is %s (%d candidates)", self.node_id,
                     winner, len(candidates))
            self._last_heartbeat = time.monotonic()
            self._set_master(winner)
            self._settled.set()
            self._callbacks.deliver(_SETTLED, winner)
            if winner == self.node_id:
                self._publish("heartbeat")
            if self._transport.peers == self._basis:
                return
            log.info("node %s: peers changed during the campaign; campaigning again",
                     self.node_id)

    def _on_peers(self, peers: frozenset[NodeId]) -> None:
        if peers != self._basis:
            self._start_campaign("connected peers changed")

    # --- messages --------------------------------------------------------------------------

    def _publish(self, kind: str, reply: bool = False) -> None:
        force, master, state, _ = self.rank
        self._transport.publish(Topic.ELECTION, {"kind": kind, "node": self.node_id,
                                                 "force": force, "master": master,
                                                 "state": state, "reply": reply,
                                                 "leader": self.leader})

    def _on_message(self, message: Any) -> None:
        try:
            kind, node = message["kind"], NodeId(message["node"])
            rank: Rank = (bool(message["force"]), bool(message["master"]),
                          bool(message["state"]), str(node))
            leader = message.get("leader")
            leader = None if leader is None else NodeId(str(leader))
        except (TypeError, KeyError, AttributeError):
            log.warning("malformed election message dropped: %r", message)
            return
        if node == self.node_id:
            return
        self._heard[node] = time.monotonic()
        self._ranks[node] = rank
        self._leaders[node] = leader
        if self._candidates is not None:
            self._candidates[node] = rank
        if kind == "candidate":
            self._on_candidate(rank, bool(message.get("reply")))
        elif kind == "heartbeat":
            self._on_heartbeat(node, rank)

    def _on_candidate(self, rank: Rank, reply: bool) -> None:
        if self.campaigning:
            return  # our own broadcasts already reach the candidate
        if not reply:
            self._publish("candidate", reply=True)
        if not self.is_master and rank < self.rank and self._would_beat_master():
            self._start_campaign("a lower-ranked node campaigns")

    def _on_heartbeat(self, node: NodeId, rank: Rank) -> None:
        if self.is_master:
            if rank > self.rank:
                log.info("node %s steps down: %s ranks higher", self.node_id, node)
                self._last_heartbeat = time.monotonic()
                self._set_master(node)
            else:
                self._publish("heartbeat")  # the lower master steps down when it hears this
            return
        if node == self._master:
            self._last_heartbeat = time.monotonic()
        elif not self.campaigning and (self._master is None or self._master_silent()
                                       or rank > self._ranks.get(self._master, rank)):
            self._last_heartbeat = time.monotonic()
            self._set_master(node)
        if rank < self.rank and not self.campaigning:
            self._start_campaign(f"master {node} ranks below this node")

    def _would_beat_master(self) -> bool:
        return self._master is None or self.rank > self._ranks.get(self._master, self.rank)

    def _master_silent(self) -> bool:
        return time.monotonic() - self._last_heartbeat > self.config.master_timeout_s

    def _set_master(self, master: NodeId | None) -> None:
        if master != self._master:
            self._master = master
            self._callbacks.deliver(_CHANGED, master)

    # --- heartbeats and the lost-master watchdog -------------------------------------------

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            if self.is_master:
                self._publish("heartbeat")
                continue
            self._publish("alive")  # counted by others as reachable (their quorum)
            if not self.campaigning and self._master is not None and self._master_silent():
                log.warning("node %s: master %s silent for %.1fs; campaigning", self.node_id,
                            self._master, time.monotonic() - self._last_heartbeat)
                self._set_master(None)
                self._start_campaign("master lost")
