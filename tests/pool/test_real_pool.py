"""The memory-gated pool on real `shoal serve` processes with SmolLM2 and Gemma 3, under a
budget that holds one of them: the second model's request evicts the idle first; keep_alive
0 unloads; 40 queued requests of mixed priorities complete in priority order; past
--max-queue a 429 with Retry-After; a pinned model is never evicted (slow)."""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_process import start_serve  # noqa: E402

pytestmark = pytest.mark.slow

# SmolLM2 (about 0.35 GiB once loaded) and Gemma 3 270M (0.56 GiB estimated, tried within
# 15% of the room) fit one at a time.
BUDGET = "700MiB"
QUEUED = 40


def loaded(node) -> list[str]:
    return sorted(m["model"] for m in httpx.get(node.url + "/api/ps", timeout=10).json()["models"])


def complete(node, model: str, **fields) -> httpx.Response:
    return httpx.post(node.url + "/v1/completions", timeout=180, json={
        "model": model, "prompt": "The capital of France is", "max_tokens": 2,
        "temperature": 0, **fields})


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {timeout_s:.0f} s")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    served = start_serve(["--standalone", "--no-preload", "--memory-budget", BUDGET,
                          "--parallel", "1", "--max-queue", str(QUEUED), "--threads", "2"],
                         tmp_path_factory.mktemp("pool"))
    yield served
    served.stop()


def test_the_second_model_evicts_the_idle_first_and_keep_alive_0_unloads(node):
    assert complete(node, "smollm2").status_code == 200
    assert loaded(node) == ["smollm2-135m-instruct"]
    gemma = complete(node, "gemma3:270m")
    assert gemma.status_code == 200, gemma.text
    assert gemma.json()["model"] == "gemma-3-270m"
    assert loaded(node) == ["gemma-3-270m"]
    held = httpx.get(node.url + "/cluster", timeout=10).json()["nodes"][0]
    assert held["memory_held"] <= held["memory_budget"]
    # keep_alive as an extension field of an OpenAI body: 0 unloads after the request.
    once = complete(node, "smollm2", keep_alive=0)
    assert once.status_code == 200, once.text
    wait_for(lambda: loaded(node) == [], 30, "every model unloaded")


def test_queued_requests_complete_in_priority_order_and_a_full_queue_is_a_429(node):
    assert complete(node, "smollm2").status_code == 200  # loaded: the queue alone decides
    busy = threading.Thread(target=complete, args=(node, "smollm2"),
                            kwargs={"max_tokens": 600, "ignore_eos": True})
    busy.start()
    wait_for(lambda: httpx.get(node.url + "/health").json()["queue"]["running"] == 1, 30,
             "the busy request running")
    finished: list[int] = []
    lock = threading.Lock()

    def ask(priority: int) -> None:
        answer = complete(node, "smollm2", max_tokens=1, x_priority=priority)
        assert answer.status_code == 200, answer.text
        with lock:
            finished.append(priority)

    priorities = [p % 10 for p in range(QUEUED)]
    random.Random(7).shuffle(priorities)
    askers = [threading.Thread(target=ask, args=(p,)) for p in priorities]
    for asker in askers:
        asker.start()
    wait_for(lambda: httpx.get(node.url + "/health").json()["queue"]["waiting"] == QUEUED, 30,
             f"{QUEUED} requests queued")
    overflow = complete(node, "smollm2")
    assert overflow.status_code == 429
    assert int(overflow.headers["Retry-After"]) >= 1
    assert "--max-queue 40" in overflow.json()["error"]["message"]
    busy.join()
    for asker in askers:
        asker.join()
    assert finished == sorted(priorities)


def test_a_pinned_model_is_never_evicted(tmp_path):
    pinned = start_serve(["--standalone", "--pin", "smollm2", "--memory-budget", BUDGET,
                          "--threads", "2"],
                         tmp_path / "pinned")
    try:
        refused = complete(pinned, "gemma3:270m")
        assert refused.status_code == 503
        message = refused.json()["error"]["message"]
        assert "memory budget is 0.68 GiB" in message and "smollm2" in message
        assert "pinned" in message
        assert loaded(pinned) == ["smollm2-135m-instruct"], httpx.get(pinned.url + "/api/ps").text
        ps = httpx.get(pinned.url + "/api/ps").json()["models"][0]
        assert ps["shoal"]["pinned"] is True and ps["expires_at"] is None
    finally:
        pinned.stop()
