"""A secured cluster of real nodes on 127.0.0.1: two nodes started with --cluster-tls form a
cluster over mutual TLS and serve a pipeline instance split over both (its ranks prove the
cluster secret at the rendezvous and on their links); a node under another CA, dialing the
cluster's endpoint, never joins (multinode, slow)."""

from __future__ import annotations

import time

import httpx
import pytest
from serve_process import free_port, start_serve
from test_multinode import agreed_master, cluster_of, wait_for

from shoal.cluster.certs import make_cluster_certs

pytestmark = [pytest.mark.multinode, pytest.mark.slow]


def test_two_tls_nodes_serve_a_split_model_and_a_node_under_another_ca_stays_out(tmp_path):
    make_cluster_certs(tmp_path / "tls")
    make_cluster_certs(tmp_path / "other-tls")
    ports: list[int] = []
    while len(ports) < 3:  # a port freed a moment ago can come back: keep them distinct
        port = free_port()
        ports += [port] if port not in ports else []

    def node(index: int, tls: str, peers: list[int]):
        args = ["--cluster-tls", str(tmp_path / tls), "--listen",
                f"tls/127.0.0.1:{ports[index]}", "--peers",
                ",".join(f"tls/127.0.0.1:{p}" for p in peers), "--no-discovery",
                "--no-preload", "--name", f"node{index + 1}", "--threads", "1",
                "--kv-cache-memory", "64MiB"]
        return start_serve(args, tmp_path / f"node{index + 1}", wait_healthy=False)

    nodes = [node(0, "tls", []), node(1, "tls", [ports[0]])]
    intruder = node(2, "other-tls", [ports[0], ports[1]])
    try:
        wait_for(lambda: agreed_master(nodes, 2), 20, "a two-node cluster over TLS")
        placed = httpx.post(nodes[0].url + "/instances", timeout=30, json={
            "model": "smollm2", "sharding": "pipeline", "min_nodes": 2})
        assert placed.status_code == 201, placed.text
        assert len({r["node_id"] for r in placed.json()["ranks"]}) == 2
        wait_for(lambda: [i["status"] for i in cluster_of(nodes[0])["instances"]]
                 == ["ready"], 90, "the pipeline instance ready")
        answer = httpx.post(nodes[1].url + "/v1/completions", timeout=60, json={
            "model": "smollm2", "prompt": "The sky is", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4

        # The intruder has dialed both nodes all along; it has a cluster of its own only.
        wait_for(lambda: (cluster_of(intruder) or {}).get("master_id"), 10,
                 "the intruder's own cluster")
        time.sleep(1.0)
        alone = cluster_of(intruder)
        for member in nodes:
            names = [n["name"] for n in cluster_of(member)["nodes"]]
            assert sorted(names) == ["node1", "node2"]
        assert [n["name"] for n in alone["nodes"]] == ["node3"]
    finally:
        for each in (*nodes, intruder):
            each.stop()
