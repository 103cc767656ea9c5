"""Run by test_netns_faults.py inside user, mount and network namespaces: three `shoal serve`
nodes in namespaces of their own (netns.py); node3's cluster link is cut (a 2|1 partition),
then healed."""

from __future__ import annotations

import os
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from namespaces import require_namespace  # noqa: E402
from netns import NetCluster  # noqa: E402
from test_multinode import agreed_master, cluster_of, wait_for  # noqa: E402

SECRET = "netns-partition-secret"
# A request ends, with its answer or a clear error, within this (a hang fails the test).
REQUEST_BOUND_S = 45.0


def self_named_masters(cluster: NetCluster) -> set[str]:
    """The nodes that report themselves the master now (one that writes)."""
    masters = set()
    for node in cluster.nodes:
        view = cluster_of(node.serve)
        if view is not None and view["master_id"] == view["node_id"]:
            masters.add(view["node_id"])
    return masters


def state_of(node) -> dict:
    return httpx.get(node.url + "/state", timeout=5).json()


def test_a_2_1_partition_then_healing(tmp_path):
    """No model loads (cheap): the minority never has a master that writes and refuses a
    placement at once with a clear error; after healing, one master, one session, one state
    on every node."""
    require_namespace()
    cluster = NetCluster(tmp_path, 3).build()
    samples: list[set[str]] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.25):
            samples.append(self_named_masters(cluster))

    sampler = threading.Thread(target=sample)
    try:
        cluster.start(SECRET)
        servers = [node.serve for node in cluster.nodes]
        wait_for(lambda: agreed_master(servers, 3), 60, "one cluster, one master")
        ids = [cluster_of(server)["node_id"] for server in servers]
        sessions_before = {state_of(n)["session"] for n in cluster.nodes}
        sampler.start()
        cut_at = time.monotonic()
        cluster.cut(cluster.nodes[2])
        wait_for(lambda: all((view := cluster_of(server)) is not None
                             and ids[2] not in [n["node_id"] for n in view["nodes"]]
                             and view["master_id"] in ids[:2] for server in servers[:2]),
                 40, "the majority without node3")
        detected_in = time.monotonic() - cut_at
        asked = time.monotonic()
        refused = httpx.post(cluster.nodes[2].url + "/instances", timeout=REQUEST_BOUND_S,
                             json={"model": "smollm2"})
        refused_in = time.monotonic() - asked
        healed_at = time.monotonic()
        cluster.heal(cluster.nodes[2])
        wait_for(lambda: agreed_master(servers, 3) in ids[:2], 60, "one master after healing")
        merged_in = time.monotonic() - healed_at
        wait_for(lambda: len({str(state_of(n)["state"]) for n in cluster.nodes}) == 1, 30,
                 "every node's state equal")
        sessions = {state_of(n)["session"] for n in cluster.nodes}
        print(f"cut seen by the majority in {detected_in:.1f} s; minority refused in "
              f"{refused_in:.1f} s; healed in {merged_in:.1f} s")
    except BaseException:
        print(cluster.describe())
        raise
    finally:
        sampling.set()
        if sampler.is_alive():
            sampler.join()
        cluster.stop()

    assert samples and all(len(masters) <= 1 for masters in samples), samples
    assert refused.status_code == 503, refused.text
    assert "reaches 1 of the cluster's 3 nodes" in refused.text
    assert refused_in < 5.0
    assert len(sessions) == 1 and len(sessions_before) == 1
