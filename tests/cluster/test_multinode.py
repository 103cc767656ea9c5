"""Real nodes as processes on 127.0.0.1 (Zenoh over loopback, no multicast): one cluster with
one agreed master, a model placed on one node answering streams sent to another, failover
after kill -9 of the master, and a node with another secret kept out (multinode, slow)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from serve_process import ServeProcess, free_port, start_serve

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

SECRET = "multinode-test-secret"


def cluster_of(node: ServeProcess) -> dict | None:
    try:
        response = httpx.get(node.url + "/cluster", timeout=2)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def wait_for(predicate, timeout_s: float, what: str) -> float:
    """Seconds until predicate() held; fails the test after timeout_s."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"{what} not reached within {timeout_s:.0f} s")
        time.sleep(0.1)
    return time.monotonic() - start


def agreed_master(nodes: Sequence[ServeProcess], size: int) -> str | None:
    """The master every node names, when all see `size` nodes and each node's memory
    reading (placement counts only nodes whose memory it knows); else None."""
    views = [cluster_of(node) for node in nodes]
    if any(v is None or len(v["nodes"]) != size
           or any(n["memory_total"] is None for n in v["nodes"]) for v in views):
        return None
    masters = {v["master_id"] for v in views}
    return masters.pop() if len(masters) == 1 and None not in masters else None


@contextmanager
def stopping(nodes: list[ServeProcess]) -> Iterator[list[ServeProcess]]:
    """The nodes, stopped on the way out however it is left (a fixture whose wait fails
    before its yield leaves no node running)."""
    try:
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def start_nodes(tmp: Path, count: int, secret: str = SECRET,
                extra: dict[int, list[str]] | None = None,
                cluster_ports: list[int] | None = None) -> list[ServeProcess]:
    """count nodes that all dial each other on loopback; none preloads a model."""
    cluster_ports = cluster_ports or [free_port() for _ in range(count)]
    nodes = []
    for index in range(count):
        peers = ",".join(f"tcp/127.0.0.1:{p}" for j, p in enumerate(cluster_ports)
                         if j != index)
        args = ["--listen", f"tcp/127.0.0.1:{cluster_ports[index]}", "--peers", peers,
                "--no-discovery", "--no-preload", "--cluster-secret", secret,
                "--name", f"node{index + 1}", "--threads", "2", "--kv-cache-memory", "128MiB",
                *(extra or {}).get(index, [])]
        nodes.append(start_serve(args, tmp / f"node{index + 1}", wait_healthy=False))
    return nodes


@pytest.fixture
def three_nodes(tmp_path):
    # node2 always wins elections, so the instance placed on node3 is not on the master.
    with stopping(start_nodes(tmp_path, 3, extra={1: ["--force-master"]})) as nodes:
        yield nodes


def test_three_nodes_serve_across_the_cluster_and_survive_losing_the_master(three_nodes):
    node1, node2, node3 = three_nodes
    formed_in = wait_for(lambda: agreed_master(three_nodes, 3), 30, "one cluster, one master")
    ids = [cluster_of(node)["node_id"] for node in three_nodes]
    assert agreed_master(three_nodes, 3) == ids[1]  # --force-master
    print(f"formation: {formed_in:.2f} s")

    placed = httpx.post(node1.url + "/instances", timeout=30, json={
        "model": "smollm2", "excluded_nodes": ids[:2]})
    assert placed.status_code == 201, placed.text
    instance = placed.json()
    assert [r["node_id"] for r in instance["ranks"]] == [ids[2]]
    assert instance["ranks"][0]["layers"] == [0, 30]
    wait_for(lambda: [i["status"] for i in cluster_of(node1)["instances"]] == ["ready"], 120,
             "the instance on node3 ready")

    client = openai.OpenAI(base_url=node1.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    question = [{"role": "user", "content": "Name three rivers."}]
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(model="smollm2", messages=question,
                                                      max_tokens=16, temperature=0,
                                                      stream=True))
    direct = httpx.post(node3.url + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": question, "max_tokens": 16, "temperature": 0}).json()
    assert streamed and streamed == direct["choices"][0]["message"]["content"]
    assert httpx.get(node1.url + "/health").json()["models"] == []  # node1 only forwarded
    listed = {m["id"]: m["state"] for m in httpx.get(node1.url + "/v1/models").json()["data"]}
    assert listed["smollm2-135m-instruct"] == "ready"  # served by the cluster

    # A model no node serves, asked of node1: placed by the master (on node1, where it
    # fits) and answered; every node's /api/ps says where it runs.
    gemma = httpx.post(node1.url + "/v1/completions", timeout=180, json={
        "model": "gemma3:270m", "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0})
    assert gemma.status_code == 200, gemma.text
    assert gemma.json()["model"] == "gemma-3-270m"
    wait_for(lambda: any(m["model"] == "gemma-3-270m" and m["shoal"]["node_id"] == ids[0]
                         for m in httpx.get(node3.url + "/api/ps").json()["models"]), 15,
             "node3 sees gemma on node1")

    node2.kill()
    # Its presence (liveliness token) goes with its process: the others stop listing it
    # within 3 s, before any silence timeout.
    gone_in = wait_for(lambda: all(
        (view := cluster_of(node)) is not None
        and ids[1] not in [n["node_id"] for n in view["nodes"]] for node in (node1, node3)),
        3, "node2 gone from GET /cluster")
    print(f"node2 gone from GET /cluster: {gone_in:.2f} s")
    failover_in = wait_for(lambda: agreed_master([node1, node3], 3) not in (None, ids[1])
                           or agreed_master([node1, node3], 2) is not None, 15,
                           "a new agreed master")
    print(f"failover: {failover_in:.2f} s")
    again = client.chat.completions.create(model="smollm2", messages=question, max_tokens=16,
                                           temperature=0)
    assert again.choices[0].message.content == streamed
    assert instance["instance_id"] in [i["instance_id"] for i in cluster_of(node1)["instances"]]


def test_a_node_with_another_secret_stays_out(tmp_path):
    ports = [free_port() for _ in range(2)]
    nodes = start_nodes(tmp_path / "a", 2, cluster_ports=ports)
    # The intruder dials the cluster's own endpoint: connected, but in another namespace.
    intruder = start_serve(["--listen", f"tcp/127.0.0.1:{free_port()}", "--peers",
                            f"tcp/127.0.0.1:{ports[0]}", "--no-discovery", "--no-preload",
                            "--cluster-secret", "another"],
                           tmp_path / "intruder", wait_healthy=False)
    try:
        wait_for(lambda: agreed_master(nodes, 2), 30, "the two-node cluster")
        wait_for(lambda: (cluster_of(intruder) or {}).get("master_id"), 10,
                 "the intruder's own cluster")
        time.sleep(2.0)  # time enough for anything that would leak across
        members = {n["node_id"] for n in cluster_of(nodes[0])["nodes"]}
        alone = cluster_of(intruder)
        assert alone["node_id"] not in members and len(members) == 2
        assert [n["node_id"] for n in alone["nodes"]] == [alone["node_id"]]
    finally:
        for node in (*nodes, intruder):
            node.stop()
