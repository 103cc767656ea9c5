"""A real `shoal serve` pulling the built-in SmolLM2 GGUF from servers in this process that
answer as Hugging Face and Ollama's registry do: a request naming a Hugging Face GGUF that is
not on disk pulls it and is answered by the real engine, greedily word for word as the
catalogue's copy of the same file answers; the ollama client pulls from the library and
deletes."""

from __future__ import annotations

import hashlib

import ollama
import pytest
from hub_servers import HubServer
from serve_process import start_serve

from shoal.catalog.resolve import resolve_model

pytestmark = pytest.mark.slow  # a real node loads a real model twice

REPO = "org/SmolLM2-135M-Instruct-GGUF"
OPTIONS = {"num_predict": 8, "temperature": 0, "seed": 0}


@pytest.fixture(scope="module")
def hub():
    smollm2 = resolve_model("smollm2").path.read_bytes()
    server = HubServer()
    server.add_hf_repo(REPO, {"SmolLM2-135M-Instruct-Q4_1.gguf": smollm2,
                              "README.md": b"# SmolLM2"})
    server.add_ollama_model("smollm2-test", "135m", {"model": smollm2,
                                                     "template": b"{{ .Prompt }}"})
    server.smollm2_digest = "sha256:" + hashlib.sha256(smollm2).hexdigest()
    yield server
    server.close()


@pytest.fixture(scope="module")
def node(hub, tmp_path_factory):
    served = start_serve(["--standalone", "--no-preload", "--threads", "2",
                          "--pull-on-demand", "all", "--ollama-registry", hub.url],
                         tmp_path_factory.mktemp("real-pull"), env={"HF_ENDPOINT": hub.url})
    yield served
    served.stop()


def test_a_request_pulls_a_hugging_face_gguf_and_the_engine_answers(node, hub):
    client = ollama.Client(host=node.url, timeout=300)
    pulled = client.generate(model=f"hf.co/{REPO}:Q4_1", prompt="The capital of France is",
                             options=OPTIONS)
    builtin = client.generate(model="smollm2", prompt="The capital of France is",
                              options=OPTIONS)
    assert pulled.response and pulled.response == builtin.response
    assert len(hub.requests_for("SmolLM2-135M-Instruct-Q4_1.gguf")) == 1
    sizes = {m.model: m.size for m in client.list().models}
    assert sizes[f"{REPO}:Q4_1"] == resolve_model("smollm2").path.stat().st_size


def test_the_ollama_client_pulls_from_the_library_and_deletes(node, hub):
    client = ollama.Client(host=node.url, timeout=300)
    progress = list(client.pull("smollm2-test:135m", stream=True))
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    assert any(p.digest == hub.smollm2_digest and p.completed == p.total for p in progress)
    assert "smollm2-test:135m" in [m.model for m in client.list().models]
    client.delete("smollm2-test:135m")
    assert "smollm2-test:135m" not in [m.model for m in client.list().models]
