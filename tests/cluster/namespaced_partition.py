"""Run by test_netns_faults.py inside user, mount and network namespaces: three `shoal serve`
nodes in namespaces of their own (netns.py), linked through relays (relay.py), form a cluster
over links with latency and loss, serve a steady load of chat streams while node3's cluster
link is cut (a 2|1 partition), then healed, copy a model over a rate-limited link, and fetch
a prompt's KV blocks from another node over the impaired links again."""

from __future__ import annotations

import os
import re
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import tiny_models  # noqa: E402
from engine.tokenizer_fixtures import tiny_byte_level_metadata  # noqa: E402
from namespaces import require_namespace  # noqa: E402
from netns import NetCluster  # noqa: E402
from relay import Impairment  # noqa: E402
from test_multinode import agreed_master, cluster_of, wait_for  # noqa: E402
from test_multinode_prefix import complete as prefix_complete  # noqa: E402

SECRET = "netns-partition-secret"
# A request ends, with its answer or a clear error, within this (a hang fails the test).
REQUEST_BOUND_S = 45.0
# A chat sent to the minority ends with an error within this: Zenoh's link lease (10 s),
# after which node3 knows node1 gone, and the wait for a first token.
MINORITY_BOUND_S = 25.0
# node3's cluster link in the rate-limit test (the tiny model is ~110 KiB: a few seconds).
COPY_RATE = "512kbit"
TINY_MODEL = "tiny-netns"
# Every link between nodes while the cluster forms (relay.py), and the slowdown allowed then.
LATENCY_S = 0.005
LOSS = 0.01
CHATS_PER_SIDE = 4
SLOWDOWN_BOUND_S = 2.0
QUESTION = [{"role": "user", "content": "Name a river."}]


@dataclass(frozen=True)
class Outcome:
    node: int
    status: int | None  # None: no answer within the bound (a hang), or the link failed
    text: str
    seconds: float


def chat(url: str, node: int) -> Outcome:
    """One streamed chat request: the HTTP status and what came back."""
    started = time.monotonic()
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=REQUEST_BOUND_S,
                          json={"model": "smollm2", "messages": QUESTION, "max_tokens": 4,
                                "temperature": 0, "stream": True}) as response:
            text = "".join(response.iter_text())
            status = response.status_code
    except httpx.HTTPError as error:
        status, text = None, f"{type(error).__name__}: {error}"
    return Outcome(node, status, text, time.monotonic() - started)


def streamed_fine(outcome: Outcome) -> bool:
    return outcome.status == 200 and "[DONE]" in outcome.text and '"error"' not in outcome.text


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


@dataclass
class Formed:
    cluster: NetCluster
    ids: list[str]  # node ids, in node order
    impairment: Impairment  # of every link between nodes (relay.py)
    formed_in: float  # seconds from the nodes healthy to one agreed master
    ready_in: float  # seconds from placing SmolLM2 to it ready

    @property
    def servers(self) -> list:
        return [node.serve for node in self.cluster.nodes]


@pytest.fixture(scope="module")
def formed(tmp_path_factory):
    """Three nodes in one cluster, SmolLM2 ready on node1 (shared by this module's tests:
    each leaves the cluster whole)."""
    require_namespace()
    cluster = NetCluster(tmp_path_factory.mktemp("netns"), 3).build()
    impairment = Impairment(LATENCY_S, LOSS)
    try:
        cluster.start(SECRET, impairment=impairment)
        servers = [node.serve for node in cluster.nodes]
        formed_in = wait_for(lambda: agreed_master(servers, 3), 60, "one cluster, one master")
        ids = [cluster_of(server)["node_id"] for server in servers]
        asked = time.monotonic()
        placed = httpx.post(cluster.nodes[0].url + "/instances", timeout=30,
                            json={"model": "smollm2", "excluded_nodes": ids[1:]})
        assert placed.status_code == 201, placed.text
        wait_for(lambda: [i["status"] for i in cluster_of(servers[1])["instances"]]
                 == ["ready"], 120, "smollm2 ready on node1")
        yield Formed(cluster, ids, impairment, formed_in, time.monotonic() - asked)
    except BaseException:
        print(cluster.describe())
        raise
    finally:
        cluster.stop()


def test_links_with_latency_and_loss_still_form_place_and_generate(formed):
    """The fixture formed the cluster and placed SmolLM2 over links that add LATENCY_S to
    every chunk and, to LOSS of them, a retransmission timeout (relay.py: a TCP relay cannot
    drop bytes, so a loss is what it costs a TCP stream: 200 ms during which nothing behind
    it arrives). Chats sent to node2 cross such a link to node1 and back; their slowdown
    against the same links unimpaired is bounded. The tests after this one run unimpaired."""
    url = formed.cluster.nodes[1].url
    impaired = [chat(url, 2) for _ in range(CHATS_PER_SIDE)]
    formed.impairment.latency_s, formed.impairment.loss = 0.0, 0.0
    clean = [chat(url, 2) for _ in range(CHATS_PER_SIDE)]
    relays = formed.cluster.relays
    slow, fast = (statistics.median(o.seconds for o in side) for side in (impaired, clean))
    print(f"links {LATENCY_S * 1000:g} ms + {LOSS:.0%} loss: formed in {formed.formed_in:.1f} s, "
          f"SmolLM2 ready in {formed.ready_in:.1f} s, chats via node2 median {slow:.2f} s "
          f"against {fast:.2f} s unimpaired (x{slow / fast:.1f}); "
          f"{sum(r.stalled for r in relays)} of {sum(r.chunks for r in relays)} chunks held "
          f"for a retransmission")
    assert all(streamed_fine(o) for o in impaired + clean)
    assert slow < fast + SLOWDOWN_BOUND_S


def test_a_2_1_partition_under_chat_load_then_healing(formed):
    """SmolLM2 on node1; two clients stream chats to node1 and node2 throughout. The
    minority (node3) never has a master that writes, refuses a placement at once and ends
    every chat with a clear error; no request hangs; after healing, one master, one
    session, one state on every node, and the one instance neither lost nor doubled."""
    cluster, ids, servers = formed.cluster, formed.ids, formed.servers
    samples: list[set[str]] = []
    outcomes: dict[str, list[Outcome]] = {"before": [], "cut": [], "healed": []}
    phase = ["before"]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.25):
            samples.append(self_named_masters(cluster))

    def load(node: int) -> None:
        while not stop.is_set():
            now = phase[0]
            outcomes[now].append(chat(cluster.nodes[node - 1].url, node))

    threads = [threading.Thread(target=sample),
               *(threading.Thread(target=load, args=(n,)) for n in (1, 2))]
    try:
        instances_before = sorted(i["instance_id"] for i in cluster_of(servers[0])["instances"])
        for thread in threads:
            thread.start()
        wait_for(lambda: len(outcomes["before"]) >= 4, 60, "chats served before the cut")

        phase[0] = "cut"
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
        minority = [chat(cluster.nodes[2].url, 3) for _ in range(2)]

        phase[0] = "healed"
        healed_at = time.monotonic()
        cluster.heal(cluster.nodes[2])
        wait_for(lambda: agreed_master(servers, 3) in ids[:2], 60, "one master after healing")
        merged_in = time.monotonic() - healed_at
        wait_for(lambda: len({str(state_of(n)["state"]) for n in cluster.nodes}) == 1, 30,
                 "every node's state equal")
        served = len(outcomes["healed"])
        wait_for(lambda: len(outcomes["healed"]) >= served + 2, 60, "chats after healing")
        sessions = {state_of(n)["session"] for n in cluster.nodes}
        instances_after = [sorted(i["instance_id"] for i in cluster_of(s)["instances"])
                           for s in servers]
    finally:
        stop.set()
        for thread in threads:
            if thread.is_alive():
                thread.join()

    every = [o for phase_outcomes in outcomes.values() for o in phase_outcomes] + minority
    print(f"cut seen by the majority in {detected_in:.1f} s; minority refused in "
          f"{refused_in:.1f} s; healed in {merged_in:.1f} s; chats per phase "
          f"{ {name: len(o) for name, o in outcomes.items()} }, slowest "
          f"{max(o.seconds for o in every):.1f} s; minority answers "
          f"{[(o.status, round(o.seconds, 1), o.text[:160]) for o in minority]}")
    assert samples and all(len(masters) <= 1 for masters in samples), samples
    assert refused.status_code == 503, refused.text
    assert "reaches 1 of the cluster's 3 nodes" in refused.text
    assert refused_in < 5.0
    assert len(sessions) == 1
    assert instances_after == [instances_before] * 3  # none lost, none doubled
    assert all(o.seconds < REQUEST_BOUND_S for o in every)  # none hangs
    # The majority serves throughout; the minority ends each chat with a clear error.
    majority = Counter(streamed_fine(o) for name in outcomes for o in outcomes[name])
    assert majority[False] == 0, [o for name in outcomes for o in outcomes[name]
                                  if not streamed_fine(o)]
    for outcome in minority:
        # Its instance is beyond the cut: node3 says so once its own link lease ends, or
        # refuses to place the model again without a quorum.
        assert outcome.status == 503, outcome
        assert ("left the cluster" in outcome.text
                or "reaches 1 of the cluster's 3 nodes" in outcome.text), outcome.text
        assert outcome.seconds < MINORITY_BOUND_S


def test_a_peer_copy_over_a_rate_limited_link_completes_while_node1_serves(formed, tmp_path):
    """node3's cluster link is held to COPY_RATE by tc tbf. node3 has no route to the others'
    API addresses, so its copy of a model only node1 holds comes over the data plane, on that
    link: it completes, while node1 goes on serving node2's clients at the pace it had
    before."""
    cluster, ids, servers = formed.cluster, formed.ids, formed.servers
    metadata = tiny_byte_level_metadata()
    model = tiny_models.build("llama", tmp_path, metadata=metadata,
                              vocab_size=len(metadata["tokenizer.ggml.tokens"])).gguf_path
    model = model.rename(model.with_name(f"{TINY_MODEL}.gguf"))
    # node1 serves it once by path: it holds the file from then on, and lists it.
    assert complete(cluster.nodes[0], str(model)) is not None
    wait_for(lambda: sum(any(m["model"] == TINY_MODEL for m in n.get("models", []))
                         for n in cluster_of(servers[2])["nodes"]) == 1, 30,
             "node1 listed as holding the model")
    before = [chat(cluster.nodes[1].url, 2) for _ in range(3)]
    during: list[Outcome] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            during.append(chat(cluster.nodes[1].url, 2))

    cluster.shape(cluster.nodes[2], COPY_RATE)
    loader = threading.Thread(target=load)
    loader.start()
    try:
        asked = time.monotonic()
        # Asked of the holder by path, placed on node3, which knows the model by its id
        # only (the file's stem) and must copy it.
        placed = httpx.post(cluster.nodes[0].url + "/instances", timeout=30,
                            json={"model": str(model), "excluded_nodes": ids[:2]})
        assert placed.status_code == 201, placed.text
        size = model.stat().st_size
        wait_for(lambda: peer_bytes(cluster.nodes[2]) >= size, 60, "the copy on node3")
        copied_in = time.monotonic() - asked
        copied = peer_bytes(cluster.nodes[2])
    finally:
        stop.set()
        loader.join()
        cluster.unshape(cluster.nodes[2])
    slowest_before = max(o.seconds for o in before)
    slowest_during = max(o.seconds for o in during)
    print(f"copy over a {COPY_RATE} link: {copied:.0f} bytes on node3 in {copied_in:.1f} s "
          f"from the placement; node1's chats "
          f"slowest {slowest_before:.1f} s before, {slowest_during:.1f} s during "
          f"({len(during)} chats)")
    assert copied == size  # the whole file came from node1, each byte once
    assert before and during and all(streamed_fine(o) for o in before + during)
    assert slowest_during < max(3 * slowest_before, 5.0)


def test_a_prefix_fetch_over_impaired_links(formed):
    """Links back at LATENCY_S and LOSS: a long prompt served on node1, then the same prompt
    in a session pinned to a SmolLM2 instance on node2, which fetches the prompt's KV blocks
    from node1 over the data plane (node2 reaches node1 only through its relayed cluster
    link); then the same with another prompt over clean links, for the slowdown."""
    cluster, ids, servers = formed.cluster, formed.ids, formed.servers
    near = httpx.post(cluster.nodes[0].url + "/instances", timeout=30, json={
        "model": "smollm2", "excluded_nodes": [ids[0], ids[2]]})
    assert near.status_code == 201, near.text
    near_id = near.json()["instance_id"]
    wait_for(lambda: statuses(servers[0], near_id) == ["ready"], 120,
             "a SmolLM2 instance on node2")

    def fetch(story: str, session: str) -> tuple[dict, dict, float]:
        prompt = story * 12  # ~400 tokens: 24 blocks to fetch
        local = prefix_complete(cluster.nodes[0], prompt)
        prefix_complete(cluster.nodes[1], "Hello there.", session=session)  # pins node2
        time.sleep(1.0)  # node1's blocks reach node2's prefix index
        started = time.monotonic()
        fetched = prefix_complete(cluster.nodes[1], prompt, session=session)
        return local, fetched, time.monotonic() - started

    formed.impairment.latency_s, formed.impairment.loss = LATENCY_S, LOSS
    try:
        impaired = fetch(PREFIX_STORY, "netns-prefix-impaired")
    finally:
        formed.impairment.latency_s, formed.impairment.loss = 0.0, 0.0
    clean = fetch(PREFIX_STORY.replace("ferryman", "boatman"), "netns-prefix-clean")
    print(f"links {LATENCY_S * 1000:g} ms + {LOSS:.0%} loss: "
          f"{impaired[1]['usage']['prompt_tokens_details']['cached_tokens']} prompt tokens "
          f"fetched from node1 in a {impaired[2]:.2f} s request, against {clean[2]:.2f} s "
          f"over clean links")
    for local, fetched, _ in (impaired, clean):
        cached = fetched["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert local["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # Every full block but the last token's came from node1.
        assert cached == (fetched["usage"]["prompt_tokens"] - 1) // 16 * 16
    log = cluster.nodes[1].serve.log_tail(400_000)
    assert log.count("prefix fetch for") >= 2 and "complete" in log.split("prefix fetch for")[1][:80]
    assert impaired[2] < clean[2] + SLOWDOWN_BOUND_S


def statuses(server, *instance_ids: str) -> list[str | None]:
    by_id = {i["instance_id"]: i["status"] for i in cluster_of(server)["instances"]}
    return [by_id.get(instance_id) for instance_id in instance_ids]


PREFIX_STORY = ("The ferryman rowed the river at dawn and counted the herons on the bank, "
                "writing each count in a book beside the tide. ")


def peer_bytes(node) -> float:
    text = httpx.get(node.url + "/metrics", timeout=5).text
    found = re.search(r'^shoal_pulled_bytes_total\{source="peer"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def complete(node, model: str) -> str | None:
    response = httpx.post(node.url + "/v1/completions", timeout=REQUEST_BOUND_S, json={
        "model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]
