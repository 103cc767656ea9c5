"""Capability cards and the remote proposer between real nodes on 127.0.0.1 (multinode,
slow): three nodes all hold all cards and a killed node's card expires; a verifier whose
guesses come from another node keeps them (float32 greedy), and when that node is killed
mid-stream the stream completes token for token as plain decoding gives it."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prompts import EDIT
from serve_process import free_port, start_serve
from test_multinode import agreed_master, cluster_of, start_nodes, wait_for

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

SECRET = "cards-test-secret"
TARGET = "smollm2-135m-instruct"
# Short card lifetimes so that a killed node's card expires within the test.
FAST_CARDS = {"SHOAL_CARD_INTERVAL": "0.5", "SHOAL_CARD_TTL": "3"}
EDIT_CHAT = [{"role": "user", "content": EDIT}]


def cards_of(node) -> dict[str, dict] | None:
    try:
        response = httpx.get(node.url + "/cluster/cards", timeout=2)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return {card["node_id"]: card for card in response.json()["cards"]}


def test_every_node_holds_every_card_and_a_killed_nodes_card_expires(tmp_path, monkeypatch):
    for name, value in FAST_CARDS.items():
        monkeypatch.setenv(name, value)
    nodes = start_nodes(tmp_path, 3, secret=SECRET, extra={2: ["--propose-for", "smollm2"]})
    try:
        wait_for(lambda: agreed_master(nodes, 3), 20, "one cluster, one master")
        ids = [cluster_of(node)["node_id"] for node in nodes]
        wait_for(lambda: all(set(cards_of(node) or ()) == set(ids) for node in nodes), 10,
                 "every node holding every card")
        seen_by_first = cards_of(nodes[0])
        offered = [(m["model"], m["role"], m["source"]) for m in seen_by_first[ids[2]]["models"]]
        assert offered == [(TARGET, "proposer", "ngram")]
        assert seen_by_first[ids[0]]["models"] == []  # nothing loaded, nothing offered
        assert {"cpu_percent", "queue_depth", "in_flight", "proposer_sessions"} <= set(
            seen_by_first[ids[1]]["load"])
        assert seen_by_first[ids[1]]["ttl_s"] == 3.0
        assert {c["node_id"] for c in cluster_of(nodes[1])["cards"]} == set(ids)

        nodes[2].kill()
        expired_in = wait_for(lambda: all(set(cards_of(node) or ()) == set(ids[:2])
                                          for node in nodes[:2]), 10, "the card expired")
        print(f"card gone after {expired_in:.1f} s")
    finally:
        for node in nodes:
            node.stop()


def chat(url: str, speculative: str | None, max_tokens: int = 100) -> dict:
    body = {"model": "smollm2", "messages": EDIT_CHAT, "max_tokens": max_tokens,
            "temperature": 0}
    if speculative is not None:
        body["x_speculative"] = speculative
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_remote_proposer_killed_mid_stream_the_stream_completes_identical(tmp_path):
    ports = [free_port(), free_port()]
    common = ["--no-discovery", "--cluster-secret", SECRET, "--threads", "1",
              "--kv-cache-memory", "128MiB"]
    verifier = start_serve(
        ["--listen", f"tcp/127.0.0.1:{ports[0]}", "--peers", f"tcp/127.0.0.1:{ports[1]}",
         "--name", "verifier", "--force-master", "--no-preload", "--dtype", "float32",
         "--speculative", "smollm2=remote:8", *common], tmp_path / "verifier",
        wait_healthy=False, env=FAST_CARDS)
    proposer = start_serve(
        ["--listen", f"tcp/127.0.0.1:{ports[1]}", "--peers", f"tcp/127.0.0.1:{ports[0]}",
         "--name", "proposer", "--no-preload", "--propose-for", "smollm2", *common],
        tmp_path / "proposer", wait_healthy=False, env=FAST_CARDS)
    try:
        wait_for(lambda: agreed_master([verifier, proposer], 2), 20, "a cluster of two")
        proposer_id = cluster_of(proposer)["node_id"]
        wait_for(lambda: proposer_id in (cards_of(verifier) or {}), 10,
                 "the proposer's card at the verifier")
        placed = httpx.post(verifier.url + "/instances", timeout=30, json={
            "model": "smollm2", "excluded_nodes": [proposer_id]})
        assert placed.status_code == 201, placed.text
        wait_for(lambda: [i["status"] for i in cluster_of(verifier)["instances"]] == ["ready"],
                 180, "smollm2 ready on the verifier")

        started = time.monotonic()
        plain = chat(verifier.url, "off")
        plain_s = time.monotonic() - started
        plain_text = plain["choices"][0]["message"]["content"]
        assert "x_speculative" not in plain["usage"]
        started = time.monotonic()
        guessed = chat(verifier.url, None)  # the model's own --speculative: remote
        guessed_s = time.monotonic() - started
        assert guessed["choices"][0]["message"]["content"] == plain_text
        usage = guessed["usage"]["x_speculative"]
        assert usage["accepted_tokens"] > 0.2 * guessed["usage"]["completion_tokens"], usage
        assert (cards_of(proposer) or {})[proposer_id]["load"]["proposer_sessions"] <= 1

        # Again, streamed, and the proposer node dies a few chunks in.
        streamed, usage, killed_after = [], None, None
        with httpx.stream("POST", verifier.url + "/v1/chat/completions", timeout=300, json={
                "model": "smollm2", "messages": EDIT_CHAT, "max_tokens": 100, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", ()):
                    streamed.append(choice["delta"].get("content") or "")
                if killed_after is None and len(streamed) >= 12:
                    killed_after = "".join(streamed)
                    proposer.kill()
        assert killed_after and len(killed_after) < len(plain_text)  # killed mid-stream
        assert "".join(streamed) == plain_text
        assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]
        # The verifier goes on alone, and still answers the same afterwards.
        started = time.monotonic()
        after = chat(verifier.url, None)
        assert after["choices"][0]["message"]["content"] == plain_text
        print(f"plain {plain_s:.1f} s, remote guesses {guessed_s:.1f} s "
              f"({guessed['usage']['x_speculative']}), after the kill "
              f"{time.monotonic() - started:.1f} s; mid-stream usage {usage}")
    finally:
        proposer.stop()
        verifier.stop()
