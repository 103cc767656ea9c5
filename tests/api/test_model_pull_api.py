"""The model store over the API: POST /api/pull streaming Ollama's status lines (through the
ollama client), GET /api/tags with sizes, DELETE /api/delete, pulled bytes in /metrics, a
request for a model not on disk pulling it first, and every failure in Ollama's dialect."""

from __future__ import annotations

import hashlib
import threading
import time

import httpx
import ollama
import pytest
from fakes import ScriptedRouter, fake_engine_config, fake_supervisor_options, write_fake_gguf
from fastapi.testclient import TestClient
from hub_servers import HubServer

from shoal.api.app import create_app
from shoal.catalog.pull.puller import Puller
from shoal.catalog.pull.settings import PullSettings
from shoal.config import ClusterSettings, NodeConfig, ServerConfig
from shoal.node import BackgroundNode
from shoal.runner.supervisor import RunnerSupervisor

MIB = 1024 * 1024
WEIGHTS = b"GGUF" + bytes(range(256)) * (3 * MIB // 256)
LAYERS = {"model": WEIGHTS, "template": b"{{ .Prompt }}", "system": b"Be brief.",
          "params": b'{"stop": ["<|im_end|>", "<|endoftext|>"], "temperature": 0.2}'}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    fake = tmp_path_factory.mktemp("hub") / "fake.gguf"
    write_fake_gguf(fake)  # a GGUF the fake engine serves
    server = HubServer()
    server.add_ollama_model("tiny", "latest", LAYERS)
    server.add_ollama_model("slow", "latest", {"model": WEIGHTS})
    server.add_ollama_model("other", "latest", {"model": fake.read_bytes()})
    server.add_ollama_model("carded", "latest", {
        "model": fake.read_bytes(), "system": b"Be brief.",
        "params": b'{"stop": ["w3"], "num_predict": 8}'})
    yield server
    server.close()


@pytest.fixture(scope="module")
def node(hub, tmp_path_factory):
    """A node whose store is empty, pulling from hub; requests may pull any name."""
    tmp = tmp_path_factory.mktemp("pull-node")
    options = fake_supervisor_options()
    config = NodeConfig(server=ServerConfig(port=0), preload=False, data_dir=tmp / "data",
                        cluster=ClusterSettings(standalone=True),
                        pull=PullSettings(ollama_registry=hub.url, on_demand="all",
                                          connect_timeout_s=2, read_timeout_s=5))
    background = BackgroundNode(config, make_supervisor=lambda source, _parallel:
                                RunnerSupervisor(fake_engine_config(tmp, source.model_id),
                                                 options))
    background.start()
    yield background
    background.stop()


def test_pull_streams_ollama_status_lines_then_lists_and_deletes(node, hub):
    client = ollama.Client(host=node.url)
    digest = "sha256:" + hashlib.sha256(WEIGHTS).hexdigest()
    progress = list(client.pull("tiny", stream=True))
    statuses = [p.status for p in progress]
    assert statuses[0] == "pulling manifest" and statuses[-2:] == ["writing manifest", "success"]
    assert "verifying sha256 digest" in statuses
    weights = [p for p in progress if p.digest == digest]
    assert weights[0].status == f"pulling {digest[7:19]}"
    assert weights[-1].total == weights[-1].completed == len(WEIGHTS)

    listed = {m.model: m for m in client.list().models}
    assert listed["tiny:latest"].size == sum(len(layer) for layer in LAYERS.values())
    shown = client.show("tiny")  # Ollama's template, system and parameters layers
    assert shown.template == "{{ .Prompt }}"
    assert httpx.post(node.url + "/api/show", json={"model": "tiny"}).json()["system"] == \
        "Be brief."
    assert shown.parameters == 'stop "<|im_end|>"\nstop "<|endoftext|>"\ntemperature 0.2'
    assert client.pull("tiny:latest", stream=False).status == "success"
    metrics = httpx.get(node.url + "/metrics").text
    (pulled,) = [line for line in metrics.splitlines()
                 if line.startswith('shoal_pulled_bytes_total{source="ollama"}')]
    assert float(pulled.split()[-1]) == sum(len(layer) for layer in LAYERS.values())

    client.delete("tiny")
    assert "tiny:latest" not in [m.model for m in client.list().models]
    with pytest.raises(ollama.ResponseError) as error:
        client.delete("tiny")
    assert error.value.status_code == 404


def test_a_request_for_a_model_not_on_disk_pulls_it_first(node, hub):
    reply = httpx.post(node.url + "/api/generate", timeout=60, json={
        "model": "other", "prompt": "hi", "stream": False, "options": {"num_predict": 2}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] in ("other", "other:latest")
    assert "other:latest" in [m["model"] for m in httpx.get(node.url + "/api/tags").json()[
        "models"]]


def test_a_models_params_layer_gives_defaults_the_request_overrides(node, hub):
    client = ollama.Client(host=node.url)
    client.pull("carded")
    assert client.generate(model="carded", prompt="hi").response == "w1 w2 "  # its stop
    overridden = client.generate(model="carded", prompt="hi", options={"stop": ["w2"]})
    assert overridden.response == "w1 "
    assert client.generate(model="other", prompt="hi", options={"num_predict": 4}).response == \
        "w1 w2 w3 w4 "  # a model without params: nothing added


def test_health_shows_a_pull_in_progress_for_the_dashboard(node, hub):
    hub.delay_s = 0.04  # ~0.4 s per MiB: the pull is seen under way, even on a busy host
    seen = []
    try:
        pulling = threading.Thread(target=lambda: ollama.Client(host=node.url).pull("slow"))
        pulling.start()
        deadline = time.monotonic() + 20
        while pulling.is_alive() and time.monotonic() < deadline:
            seen += httpx.get(node.url + "/health").json()["pulls"]
            time.sleep(0.02)
        pulling.join(20)
    finally:
        hub.delay_s = 0.0
    assert seen and all(p["model"] == "slow" for p in seen)
    assert any(0 < p["completed"] < p["total"] == len(WEIGHTS) for p in seen)
    assert httpx.get(node.url + "/health").json()["pulls"] == []


def test_failures_answer_in_ollamas_dialect(node, hub):
    client = ollama.Client(host=node.url)
    with pytest.raises(ollama.ResponseError) as error:
        client.pull("missing")
    assert error.value.status_code == 404 and "no such model" in error.value.error
    with pytest.raises(ollama.ResponseError) as error:
        client.pull("not a name")
    assert error.value.status_code == 400
    bad = httpx.post(node.url + "/api/pull", json={})
    assert bad.status_code == 400 and bad.json() == {"error": "model is required"}


def test_a_full_disk_is_a_507_and_nothing_is_listed(hub, tmp_path):
    puller = Puller(tmp_path, PullSettings(ollama_registry=hub.url), catalog=(),
                    free_bytes=lambda _path: 1024)
    app = TestClient(create_app(ScriptedRouter(), list_available=list, puller=puller))
    answer = app.post("/api/pull", json={"model": "tiny"})
    assert answer.status_code == 507 and "not enough free disk" in answer.json()["error"]
    assert puller.store.entries() == []


def test_models_disk_never_evicts_a_loaded_model(hub, tmp_path):
    options = fake_supervisor_options()
    config = NodeConfig(server=ServerConfig(port=0), preload=False, data_dir=tmp_path / "data",
                        cluster=ClusterSettings(standalone=True),
                        pull=PullSettings(ollama_registry=hub.url, on_demand="all",
                                          models_disk=5 * MIB))
    bounded = BackgroundNode(config, make_supervisor=lambda source, _parallel:
                             RunnerSupervisor(fake_engine_config(tmp_path, source.model_id),
                                              options))
    bounded.start()
    try:
        client = ollama.Client(host=bounded.url)
        client.generate(model="other", prompt="hi", options={"num_predict": 1})  # loaded
        client.pull("tiny")
        client.pull("slow")  # 3 MiB more than 5 MiB allow: "tiny" goes, "other" is in use
        pulled = sorted(m.model for m in client.list().models if m.model.endswith(":latest"))
        assert pulled == ["other:latest", "slow:latest"]
    finally:
        bounded.stop()


def test_a_models_system_layer_is_the_system_prompt_unless_the_request_has_one():
    from types import SimpleNamespace

    from shoal.api.ollama.model_defaults import with_model_defaults
    from shoal.api.ollama.schemas import ChatRequest, GenerateRequest

    class Cards:
        def card_of(self, name):
            return {"system": "Be brief.", "params": {"top_k": 5}} if name == "carded" else {}

    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(puller=Cards())))
    chat = with_model_defaults(ChatRequest(model="carded:latest", messages=[
        {"role": "user", "content": "hi"}], options={"top_k": 9}), request)
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."),
                                                            ("user", "hi")]
    assert chat.options == {"top_k": 9}
    own = with_model_defaults(ChatRequest(model="carded", messages=[
        {"role": "system", "content": "Be long."}, {"role": "user", "content": "hi"}]), request)
    assert [m.content for m in own.messages] == ["Be long.", "hi"] and own.options == {"top_k": 5}
    assert with_model_defaults(GenerateRequest(model="carded", prompt="x"), request).system == \
        "Be brief."
    plain = GenerateRequest(model="other", prompt="x")
    assert with_model_defaults(plain, request) is plain
