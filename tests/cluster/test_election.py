"""Bully election over the in-memory transport, with short timings."""

from __future__ import annotations

import asyncio
import time

import pytest
from cluster_waits import wait_until

from shoal.cluster.election import Election, ElectionConfig
from shoal.cluster.transport import MemoryHub
from shoal.ids import NodeId

FAST = ElectionConfig(campaign_s=0.15, heartbeat_s=0.05, master_timeout_s=0.3)


async def _start(hub: MemoryHub, names, config: ElectionConfig = FAST,
                 forced: frozenset[str] = frozenset()) -> dict[str, Election]:
    elections = {}
    for name in names:
        election = Election(hub.connect(name),
                            ElectionConfig(campaign_s=config.campaign_s,
                                           heartbeat_s=config.heartbeat_s,
                                           master_timeout_s=config.master_timeout_s,
                                           force_master=name in forced))
        await election.start()
        elections[name] = election
    return elections


async def _stop(elections) -> None:
    for election in elections.values():
        await election.stop()


def _agreed(elections, master: str | None = None) -> bool:
    masters = {e.master for e in elections.values()}
    return (len(masters) == 1 and None not in masters
            and not any(e.campaigning for e in elections.values())
            and (master is None or masters == {master}))


def test_one_master_agreed_and_the_highest_id_wins():
    async def main():
        elections = await _start(MemoryHub(), ["n2", "n3", "n1"])
        try:
            await wait_until(lambda: _agreed(elections, "n3"), what="agreement on n3")
            master = await elections["n1"].wait_for_master(timeout=1)
            roles = sorted(name for name, e in elections.items() if e.is_master)
            await asyncio.sleep(5 * FAST.heartbeat_s)  # and it stays that way
            return master, roles, _agreed(elections, "n3")
        finally:
            await _stop(elections)

    assert asyncio.run(main()) == ("n3", ["n3"], True)


def test_a_joining_node_does_not_displace_a_working_master():
    async def main():
        hub = MemoryHub()
        elections = await _start(hub, ["n1", "n2"])
        try:
            await wait_until(lambda: _agreed(elections, "n2"))
            elections |= await _start(hub, ["n3"])  # a higher id joins
            await wait_until(lambda: elections["n3"].master is not None
                             and _agreed(elections), what="n3 settles")
            await asyncio.sleep(2 * FAST.campaign_s)
            return {name: e.master for name, e in elections.items()}
        finally:
            await _stop(elections)

    assert asyncio.run(main()) == {"n1": "n2", "n2": "n2", "n3": "n2"}


def test_a_node_holding_state_beats_a_higher_id_without_it():
    async def main():
        hub = MemoryHub()
        elections = {"n1": Election(hub.connect("n1"), FAST, has_state=lambda: True),
                     "n2": Election(hub.connect("n2"), FAST)}
        for election in elections.values():
            await election.start()
        try:
            await wait_until(lambda: _agreed(elections, "n1"))
        finally:
            await _stop(elections)

    asyncio.run(main())


def test_force_master_wins_over_a_higher_id():
    async def main():
        elections = await _start(MemoryHub(), ["n1", "n2", "n3"], forced=frozenset({"n1"}))
        try:
            await wait_until(lambda: _agreed(elections, "n1"), what="agreement on n1")
        finally:
            await _stop(elections)

    asyncio.run(main())


def test_silent_master_is_detected_and_replaced_within_the_bound():
    async def main():
        hub = MemoryHub()
        elections = await _start(hub, ["n1", "n2", "n3"])
        changes = []
        elections["n1"].on_master_changed(changes.append)
        try:
            await wait_until(lambda: _agreed(elections, "n3"))
            # The master's election stops but its link stays up: no peer change reports
            # the loss, only the missing heartbeats do.
            await elections.pop("n3").stop()
            started = time.monotonic()
            await wait_until(lambda: _agreed(elections, "n2"),
                             timeout=FAST.failover_bound_s + 1.0, what="new master")
            return time.monotonic() - started, list(changes)
        finally:
            await _stop(elections)

    took, changes = asyncio.run(main())
    assert took <= FAST.failover_bound_s + 0.5  # slack for a loaded machine
    assert changes[-2:] == [None, "n2"]  # lost, then replaced


def test_dropped_master_is_replaced_via_the_peer_change():
    async def main():
        hub = MemoryHub()
        # Heartbeat silence alone would take 5 s to notice: the peer change is what acts.
        patient = ElectionConfig(campaign_s=0.15, heartbeat_s=0.05, master_timeout_s=5.0)
        elections = await _start(hub, ["n1", "n2", "n3"], config=patient)
        try:
            await wait_until(lambda: _agreed(elections, "n3"))
            elections.pop("n3")
            hub.drop(NodeId("n3"))
            # The peer change starts the campaign at once: well under the heartbeat timeout.
            return await wait_until(lambda: _agreed(elections, "n2"), what="new master")
        finally:
            await _stop(elections)

    assert asyncio.run(main()) < 2.5


def test_campaign_not_restarted_when_peers_are_unchanged():
    async def main():
        hub = MemoryHub()
        elections = await _start(hub, ["n1", "n2"])
        try:
            await wait_until(lambda: _agreed(elections, "n2"))
            await asyncio.sleep(2 * FAST.campaign_s)
            before = {name: e.campaigns for name, e in elections.items()}
            for _ in range(5):  # flapping links re-report the same set
                for name in elections:
                    hub.reannounce(NodeId(name))
                await asyncio.sleep(FAST.heartbeat_s)
            after = {name: e.campaigns for name, e in elections.items()}
            return before, after, any(e.campaigning for e in elections.values())
        finally:
            await _stop(elections)

    before, after, campaigning = asyncio.run(main())
    assert before == after and not campaigning


def test_running_campaign_finishes_before_the_next_one():
    async def main():
        hub = MemoryHub()
        slow = ElectionConfig(campaign_s=0.4, heartbeat_s=0.05, master_timeout_s=0.3)
        elections = await _start(hub, ["n1"], config=slow)
        await asyncio.sleep(0.1)
        assert elections["n1"].campaigning
        elections |= await _start(hub, ["n2"], config=slow)  # peers change mid-campaign
        try:
            await wait_until(lambda: _agreed(elections, "n2"), what="agreement on n2")
            # n1's first campaign was not cancelled: it completed, then one more followed
            # because the peer set had changed while it ran.
            return elections["n1"].campaigns
        finally:
            await _stop(elections)

    assert asyncio.run(main()) == 2


def test_partition_heal_converges_on_the_highest_node():
    async def main():
        hub = MemoryHub()
        elections = await _start(hub, ["n1", "n2", "n3"])
        try:
            await wait_until(lambda: _agreed(elections, "n3"))
            hub.partition({NodeId("n1"), NodeId("n2")}, {NodeId("n3")})
            await wait_until(lambda: elections["n1"].master == "n2"
                             and elections["n2"].is_master and elections["n3"].is_master,
                             what="two sides each elect")
            hub.heal()
            await wait_until(lambda: _agreed(elections, "n3"), what="healed agreement")
        finally:
            await _stop(elections)

    asyncio.run(main())


def test_config_is_validated():
    with pytest.raises(ValueError, match="positive"):
        ElectionConfig(campaign_s=0)
    with pytest.raises(ValueError, match="two heartbeats"):
        ElectionConfig(heartbeat_s=1.0, master_timeout_s=1.5)


def test_a_node_counts_no_other_leader_toward_its_quorum():
    """reachable() feeds the quorum: a node that leads (its messages say it holds the role)
    or follows another leader is not counted by a node that would lead itself, as when
    two campaigns missed each other's candidacies."""
    def message(node: str, kind: str, leads: bool, leader: str | None) -> dict:
        return {"kind": kind, "node": node, "force": False, "master": leads, "state": False,
                "reply": False, "leader": leader}

    async def main():
        elections = await _start(MemoryHub(), ["n1", "n2", "n3"])
        try:
            await wait_until(lambda: _agreed(elections, "n3"), what="agreement on n3")
            await asyncio.sleep(3 * FAST.heartbeat_s)
            follower = elections["n1"].reachable()
            n3 = elections["n3"]
            n3._on_message(message("n0", "heartbeat", True, None))  # a lower master
            n3._on_message(message("m1", "alive", False, "n0"))  # following it
            n3._on_message(message("m2", "alive", False, None))
            return follower, n3.reachable()
        finally:
            await _stop(elections)

    follower, master = asyncio.run(main())
    assert follower == {"n1", "n2", "n3"}  # its own master and fellow followers count
    assert master == {"n1", "n2", "n3", "m2"}
