"""One memory budget over both backends: SmolLM2 served by llama-server and the same file
under another name served by shoal's engine evict each other (slow)."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from shoal.catalog.resolve import resolve_model
from shoal.config import BackendSettings, ClusterSettings, NodeConfig, PoolSettings, ServerConfig
from shoal.config import EngineDefaults
from shoal.node import BackgroundNode

pytestmark = pytest.mark.slow

# Placement's estimate for SmolLM2 under the engine is about 345 MiB (it then holds about
# 360) and llama-server holds about 280 MiB of it once loaded: either fits the budget alone,
# never both. (What llama-server held is never taken for the engine's size of the same file.)
BUDGET = 450 * 2**20
SERVED = "smollm2-135m-instruct"


def loaded(url: str) -> list[str]:
    return sorted(m["model"] for m in httpx.get(url + "/api/ps", timeout=10).json()["models"])


def complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=180, json={
        "model": model, "prompt": "The capital of France is", "max_tokens": 2,
        "temperature": 0})


def backends_of(url: str) -> dict[str, str]:
    return {i["model"]: i["backend"]
            for i in httpx.get(url + "/cluster", timeout=10).json()["instances"]}


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {timeout_s:.0f} s")
        time.sleep(0.1)


def llama_servers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if p.name() == "llama-server" and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def node(tmp_path_factory, llama_server_binary):
    tmp = tmp_path_factory.mktemp("llama-server-pool")
    engine_copy = tmp / "smollm2-by-path.gguf"
    engine_copy.symlink_to(resolve_model(SERVED).path)
    config = NodeConfig(
        server=ServerConfig(port=0), preload=False, data_dir=tmp,
        cluster=ClusterSettings(standalone=True),
        engine=EngineDefaults(max_model_len=2048, threads=2),
        pool=PoolSettings(memory_budget=BUDGET),
        backends=BackendSettings(llama_server=llama_server_binary,
                                 assigned=((SERVED, "llama-server"),)))
    background = BackgroundNode(config, start_timeout_s=300)
    background.start()
    yield background.url, str(engine_copy)
    background.stop()


def test_an_engine_model_and_a_llama_server_model_evict_each_other(node):
    url, engine_copy = node
    assert complete(url, "smollm2").status_code == 200
    assert loaded(url) == [SERVED] and backends_of(url) == {SERVED: "llama-server"}
    assert len(llama_servers()) == 1
    served = complete(url, engine_copy)
    assert served.status_code == 200, served.text
    engine_model = served.json()["model"]  # named by the file it links to
    assert engine_model != SERVED
    assert loaded(url) == [engine_model] and backends_of(url) == {engine_model: "engine"}
    wait_for(lambda: not llama_servers(), 10, "the evicted llama-server gone")
    again = complete(url, "smollm2")
    assert again.status_code == 200, again.text
    assert loaded(url) == [SERVED] and len(llama_servers()) == 1
    held = httpx.get(url + "/cluster", timeout=10).json()["nodes"][0]
    assert held["memory_held"] <= held["memory_budget"]
