"""Prefix KV between two real nodes on 127.0.0.1, float32 (multinode, slow): a long prompt
served on node1; the same prompt pinned to node2 by x_session_id fetches the prefix from
node1 over the data plane (node2's usage shows it cached) and answers token-identically; a
holder killed while it sends still leaves the request answered, correctly."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from test_multinode import agreed_master, cluster_of, start_nodes, wait_for

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

STORY = ("The lighthouse keeper counted the ships that passed the rocks at night, and wrote "
         "each name in a ledger with the hour and the weather. ")


def complete(node, prompt: str, session: str | None = None, timeout_s: float = 120) -> dict:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    if session is not None:
        body["x_session_id"] = session
    response = httpx.post(node.url + "/v1/completions", json=body, timeout=timeout_s)
    assert response.status_code == 200, response.text
    return response.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture
def two_nodes(tmp_path):
    nodes = start_nodes(tmp_path, 2, extra={0: ["--dtype", "float32"],
                                            1: ["--dtype", "float32", "--force-master"]})
    yield nodes
    for node in nodes:
        node.stop()


def place_on_each(nodes) -> None:
    ids = [cluster_of(node)["node_id"] for node in nodes]
    for index in range(len(nodes)):
        placed = httpx.post(nodes[0].url + "/instances", timeout=30, json={
            "model": "smollm2", "excluded_nodes": [n for j, n in enumerate(ids) if j != index]})
        assert placed.status_code == 201, placed.text
    wait_for(lambda: [i["status"] for i in cluster_of(nodes[0])["instances"]]
             == ["ready", "ready"], 180, "an instance ready on each node")


class LogWatch:
    """Waits for a line that appears in a log after this watch was made: it reads only
    what was appended since, every few milliseconds (a whole-file read per poll would be
    too slow to catch a transfer in its first parts)."""

    def __init__(self, path, text: str) -> None:
        self._path = path
        self._text = text.encode()
        self._offset = path.stat().st_size

    def wait(self, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        seen = b""
        with open(self._path, "rb") as log:
            log.seek(self._offset)
            while self._text not in seen:
                if time.monotonic() > deadline:
                    pytest.fail(f"{what} not seen within {timeout_s:.0f} s")
                chunk = log.read()
                if chunk:
                    seen = seen[-len(self._text):] + chunk
                else:
                    time.sleep(0.002)


def pin_session_to(node, session: str) -> None:
    """A short first turn on node: no prefix anywhere, so node's own instance serves it."""
    complete(node, "Hello there.", session=session)


def test_the_prefix_comes_from_the_other_node_and_a_killed_holder_costs_only_a_prefill(
        two_nodes):
    node1, node2 = two_nodes
    wait_for(lambda: agreed_master(two_nodes, 2), 15, "one cluster, one master")
    place_on_each(two_nodes)

    prompt = STORY * 12  # ~ 400 tokens
    local = complete(node1, prompt)
    assert cached(local) == 0
    pin_session_to(node2, "conversation-1")
    time.sleep(1.0)  # node1's blocks reach node2's index (published every 0.25 s)
    fetched = complete(node2, prompt, session="conversation-1")
    assert fetched["choices"][0]["text"] == local["choices"][0]["text"]
    prompt_tokens = fetched["usage"]["prompt_tokens"]
    assert cached(fetched) == (prompt_tokens - 1) // 16 * 16  # every full block but the last token's
    assert "complete" in node2.log_tail(200_000).split("prefix fetch for")[-1][:80]

    # The holder dies while it sends: its first part has arrived, the rest never will.
    # node2 imports what came, prefills the rest and answers as a local prefill would.
    # ~2,000 tokens: ~12 parts of 8 MiB, about a second on loopback, so the kill
    # lands within the first few parts (the log is watched every few ms).
    longer = "Another night at the lighthouse. " + STORY * 75
    reference = complete(node1, longer)
    pin_session_to(node2, "conversation-2")
    time.sleep(1.0)
    first_part = LogWatch(node2.log_path, "arriving after")
    answers: list[dict] = []
    asking = threading.Thread(target=lambda: answers.append(
        complete(node2, longer, session="conversation-2")))
    started = time.monotonic()
    asking.start()
    first_part.wait(30, "node1's first part at node2")
    node1.kill()
    asking.join(120)
    assert answers, "the request on node2 was not answered"
    answer = answers[0]
    assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
    outcome = node2.log_tail(500_000).split("prefix fetch for")[-1].splitlines()[0]
    assert "complete" not in outcome and "after" in outcome, outcome  # cut mid-transfer
    full = (answer["usage"]["prompt_tokens"] - 1) // 16 * 16
    assert 0 < cached(answer) < full  # the parts that came were used
    print(f"answered {time.monotonic() - started:.2f} s after asking, "
          f"{cached(answer)} of {full} cacheable tokens fetched; {outcome.strip()}")
