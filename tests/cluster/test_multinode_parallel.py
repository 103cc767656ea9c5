"""One model over two real nodes on 127.0.0.1: a pipeline and a tensor instance answer in
float32 exactly as a single-node instance does, several requests at once; killing a rank
mid-stream ends the stream with an error in bounded time and the model serves again
(multinode, slow)."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_multinode import cluster_of, start_nodes, stopping, wait_for

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

PROMPTS = ["The three primary colours are", "def fibonacci(n):\n",
           "Once upon a time in a small village, there lived"]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    with stopping(start_nodes(tmp_path_factory.mktemp("parallel"), 2,
                              extra={0: ["--dtype", "float32"], 1: ["--dtype", "float32"]})
                  ) as nodes:
        wait_for(lambda: _formed(nodes), 20, "a two-node cluster")
        yield nodes


def _formed(nodes) -> bool:
    views = [cluster_of(node) for node in nodes]
    return all(v and len(v["nodes"]) == 2 and v["master_id"] for v in views)


def place(node, model: str, sharding: str, min_nodes: int) -> dict:
    response = httpx.post(node.url + "/instances", timeout=60, json={
        "model": model, "sharding": sharding, "min_nodes": min_nodes})
    assert response.status_code == 201, response.text
    instance = response.json()
    wait_for(lambda: _status(node, instance["instance_id"]) == "ready", 240,
             f"{sharding} instance of {model} ready")
    return instance


def _status(node, instance_id: str) -> str | None:
    for instance in (cluster_of(node) or {}).get("instances", []):
        if instance["instance_id"] == instance_id:
            return instance["status"]
    return None


def runner_pids(node) -> list[str]:
    found = subprocess.run(["pgrep", "-P", str(node.proc.pid), "-f", "shoal.runner.entrypoint"],
                           capture_output=True, text=True)
    return found.stdout.split()


def delete(node, instance_id: str, nodes=()) -> None:
    """Delete an instance; every runner of the given nodes is gone within 5 s of it."""
    assert httpx.delete(f"{node.url}/instances/{instance_id}", timeout=10).status_code == 200
    wait_for(lambda: _status(node, instance_id) is None, 30, "instance deleted")
    wait_for(lambda: not any(runner_pids(n) for n in nodes), 5, "every rank shut down")


def complete(node, model: str, prompt: str, max_tokens: int = 16) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    response = httpx.post(node.url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def answers(node, model: str) -> list[str]:
    """The three prompts at once, through the given node."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: complete(node, model, p), PROMPTS))


@pytest.mark.parametrize("model", ["smollm2", "gemma-3-270m"])
def test_pipeline_and_tensor_instances_answer_as_one_node(two_nodes, model):
    first, second = two_nodes
    single = place(first, model, "single", 1)
    expected = answers(first, model)  # batched equals one at a time in float32
    delete(first, single["instance_id"], two_nodes)
    for sharding in ("pipeline", "tensor"):
        instance = place(first, model, sharding, 2)
        assert len({r["node_id"] for r in instance["ranks"]}) == 2
        if sharding == "pipeline":
            assert [r["layers"][0] for r in instance["ranks"]][0] == 0
        assert answers(second, model) == expected, (model, sharding)
        delete(first, instance["instance_id"], two_nodes)


def test_killing_a_rank_mid_stream_ends_it_with_an_error_and_the_model_serves_again(two_nodes):
    first = two_nodes[0]
    instance = place(first, "smollm2", "pipeline", 2)
    assert_killing_rank1_mid_stream_ends_it_and_the_model_serves_again(
        two_nodes, instance, "smollm2", 2000)

def assert_killing_rank1_mid_stream_ends_it_and_the_model_serves_again(
        two_nodes, instance: dict, model: str, max_tokens: int) -> None:
    """kill -9 of rank 1's runner after 5 streamed chunks: the stream's last event is a
    service_unavailable error within 10 s, and the model is placed again and answers."""
    first, second = two_nodes
    rank1_node = instance["ranks"][1]["node_id"]
    node_of_rank1 = next(n for n in two_nodes if cluster_of(n)["node_id"] == rank1_node)
    [runner_pid] = runner_pids(node_of_rank1)
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    events, killed_at = [], None
    with httpx.stream("POST", first.url + "/v1/completions", json=body, timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 5:
                    subprocess.run(["kill", "-9", runner_pid], check=True)
                    killed_at = time.monotonic()
    ended_after = time.monotonic() - killed_at
    assert "error" in events[-1] and ended_after < 10
    assert events[-1]["error"]["type"] == "service_unavailable"
    wait_for(lambda: any(i["status"] == "ready" and i["instance_id"] != instance["instance_id"]
                         for i in cluster_of(first)["instances"]), 120, "re-placed and ready")
    assert complete(second, model, "The sky is", 8)
