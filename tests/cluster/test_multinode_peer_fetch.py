"""Model files travel between real nodes on 127.0.0.1 (multinode, slow): two of three nodes
hold a tiny model; a request for it by id on the third is served after that node copies the
file from a holder, with the bytes counted and the copy identical to the original, even
though the holder it copies from is killed part-way (the other holder finishes the copy).
A 2-rank pipeline placed on the two nodes that lack the model answers as one node does, each
rank having copied only its layers' bytes; a 2-rank expert instance of a mixture-of-experts
model likewise, each rank having copied only its experts' slices."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
from engine import tiny_models  # tests/engine, a namespace package on tests/'s path
from engine.tokenizer_fixtures import tiny_byte_level_metadata
from test_multinode import agreed_master, cluster_of, start_nodes, wait_for
from test_multinode_parallel import complete

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

MODEL_ID = "tiny-peer"  # the model's id on every node: its file's stem
COPY_S = 6.0  # the asking node copies at a rate that takes about this long


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    metadata = tiny_byte_level_metadata()
    checkpoint = tiny_models.build("llama", tmp_path_factory.mktemp("tiny"), metadata=metadata,
                                   vocab_size=len(metadata["tokenizer.ggml.tokens"]))
    return checkpoint.gguf_path.rename(checkpoint.gguf_path.with_name(f"{MODEL_ID}.gguf"))


def peer_bytes(node) -> float:
    text = httpx.get(node.url + "/metrics", timeout=5).text
    found = re.search(r'^shoal_pulled_bytes_total\{source="peer"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def holders_seen_by(node, count: int) -> bool:
    view = cluster_of(node) or {}
    return sum(any(m["model"] == MODEL_ID for m in n.get("models", []))
               for n in view.get("nodes", [])) == count


def test_a_node_lacking_a_model_copies_it_from_a_holder_even_when_one_dies(tmp_path,
                                                                           model_path):
    size = model_path.stat().st_size
    rate = str(int(size / COPY_S))
    # node2 masters (the holder killed is never the master) and copies slowly.
    nodes = start_nodes(tmp_path, 3, extra={
        0: ["--dtype", "float32"], 2: ["--dtype", "float32"],
        1: ["--dtype", "float32", "--force-master", "--peer-fetch-rate", rate]})
    try:
        first, asker, third = nodes
        # One master all agree on first: a request in flight when the master changes fails
        # and is retried on another instance, and these tests count instances.
        wait_for(lambda: agreed_master(nodes, 3), 30, "a three-node cluster")
        # Two holders serve it once by path (resolved there, so listed), then unload it.
        expected = complete(first, str(model_path), "Once upon a time")
        assert complete(third, str(model_path), "Once upon a time") == expected
        for holder in (first, third):
            for instance in cluster_of(holder)["instances"]:
                httpx.delete(f"{holder.url}/instances/{instance['instance_id']}", timeout=10)
        wait_for(lambda: not cluster_of(asker)["instances"], 30, "the instances deleted")
        wait_for(lambda: holders_seen_by(asker, 2), 30, "both holders listed")

        answer: dict[str, str] = {}
        request = threading.Thread(target=lambda: answer.update(
            text=complete(asker, MODEL_ID, "Once upon a time")))
        started = time.monotonic()
        request.start()
        wait_for(lambda: peer_bytes(asker) > 0, 30, "the copy under way")
        # The copy goes to the holder with the smaller node id first: kill that one.
        ids = {cluster_of(n)["node_id"]: n for n in (first, third)}
        ids[min(ids)].kill()
        request.join(120)
        assert not request.is_alive(), "the request did not end"
        took = time.monotonic() - started
        assert answer["text"] == expected
        copies = list((asker.data_dir / "models" / "store").rglob(f"{MODEL_ID}.gguf"))
        assert [c.read_bytes() for c in copies] == [model_path.read_bytes()]
        # Every byte counted once: what the dead holder sent was resumed, not fetched again.
        assert peer_bytes(asker) == size
        assert took < COPY_S + 30
    finally:
        for node in nodes:
            node.stop()


def test_a_pipeline_on_two_nodes_lacking_the_model_fetches_each_rank_s_layers_only(
        tmp_path, model_path):
    from test_multinode_parallel import delete

    nodes = start_nodes(tmp_path, 3, extra={i: ["--dtype", "float32"] for i in range(3)})
    try:
        holder, second, third = nodes
        # One master all agree on first: a request in flight when the master changes fails
        # and is retried on another instance, and these tests count instances.
        wait_for(lambda: agreed_master(nodes, 3), 30, "a three-node cluster")
        # Served once by path on the holder (resolved there, so listed), then unloaded.
        expected = complete(holder, str(model_path), "Once upon a time")
        [single] = cluster_of(holder)["instances"]
        assert single["model"] == MODEL_ID  # the id every rank names the model by
        delete(holder, single["instance_id"], nodes)
        wait_for(lambda: holders_seen_by(second, 1), 30, "the holder listed")
        holder_id = cluster_of(holder)["node_id"]
        response = httpx.post(holder.url + "/instances", timeout=60, json={
            "model": str(model_path), "sharding": "pipeline", "min_nodes": 2,
            "excluded_nodes": [holder_id]})
        assert response.status_code == 201, response.text
        ranks = response.json()["ranks"]
        assert holder_id not in {rank["node_id"] for rank in ranks} and len(ranks) == 2
        wait_for(lambda: any(i["status"] == "ready" for i in cluster_of(second)["instances"]),
                 240, "the pipeline ready")
        assert complete(second, MODEL_ID, "Once upon a time") == expected
        size = model_path.stat().st_size
        for node in (second, third):
            fetched = peer_bytes(node)  # its layers' share, not the whole file
            assert 0 < fetched < 0.8 * size, (fetched, size)
            [copy] = (node.data_dir / "models" / "ranks").rglob(f"{MODEL_ID}.gguf")
            assert copy.stat().st_size == size  # the original's layout, holes elsewhere
        assert not list((second.data_dir / "models" / "store").rglob("*.gguf"))
    finally:
        for node in nodes:
            node.stop()


def test_an_expert_instance_on_two_nodes_lacking_the_model_fetches_each_rank_s_experts_only(
        tmp_path):
    from test_multinode_parallel import answers, delete

    metadata = tiny_byte_level_metadata()
    checkpoint = tiny_models.build("qwen3moe", tmp_path / "moe", metadata=metadata,
                                   vocab_size=len(metadata["tokenizer.ggml.tokens"]))
    model_path = checkpoint.gguf_path.rename(checkpoint.gguf_path.with_name("tiny-moe.gguf"))
    nodes = start_nodes(tmp_path / "nodes", 3,
                        extra={i: ["--dtype", "float32"] for i in range(3)})
    try:
        holder, second, third = nodes
        # One master all agree on first: a request in flight when the master changes fails
        # and is retried on another instance, and these tests count instances.
        wait_for(lambda: agreed_master(nodes, 3), 30, "a three-node cluster")
        expected = answers(holder, str(model_path))
        [single] = cluster_of(holder)["instances"]
        delete(holder, single["instance_id"], nodes)
        wait_for(lambda: sum(any(m["model"] == "tiny-moe" for m in n.get("models", []))
                             for n in cluster_of(second)["nodes"]) == 1, 30, "the holder listed")
        holder_id = cluster_of(holder)["node_id"]
        response = httpx.post(holder.url + "/instances", timeout=60, json={
            "model": str(model_path), "sharding": "expert", "min_nodes": 2,
            "excluded_nodes": [holder_id]})
        assert response.status_code == 201, response.text
        ranks = response.json()["ranks"]
        assert holder_id not in {rank["node_id"] for rank in ranks} and len(ranks) == 2
        wait_for(lambda: any(i["status"] == "ready" for i in cluster_of(second)["instances"]),
                 240, "the expert instance ready")
        assert answers(second, "tiny-moe") == expected
        size = model_path.stat().st_size
        for node in (second, third):
            fetched = peer_bytes(node)  # every layer, but half of each layer's experts
            assert 0 < fetched < 0.9 * size, (fetched, size)
            [copy] = (node.data_dir / "models" / "ranks").rglob("tiny-moe.gguf")
            assert copy.stat().st_size == size
    finally:
        for node in nodes:
            node.stop()
