"""POST /v1/embeddings, /api/embed and /api/embeddings over a node thread serving the fake
embedding engine (tests/fake_embedding.py) beside the fake text engine."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from fake_embedding import MAX_MODEL_LEN, fake_embedding_source, fake_vector
from fakes import FakeTokenizer, fake_engine_config, fake_supervisor_options

from shoal.catalog.resolve import ModelNotFound
from shoal.config import ClusterSettings, NodeConfig, ServerConfig
from shoal.engine.config import EngineConfig
from shoal.node import BackgroundNode
from shoal.runner.supervisor import RunnerSupervisor


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed-node")
    embedder = fake_embedding_source(tmp)
    sources = {"fake-embed": embedder, "embed-alias": embedder,
               "fake-model": fake_engine_config(tmp, "fake-model").source}

    def resolve(name):
        if name not in sources:
            raise ModelNotFound(f"model {name!r} not found")
        return sources[name]

    options = fake_supervisor_options(fake_engine="embedding")

    config = NodeConfig(server=ServerConfig(port=0), models=("fake-model",), data_dir=tmp,
                        cluster=ClusterSettings(standalone=True))
    background = BackgroundNode(
        config, make_supervisor=lambda source, _parallel: RunnerSupervisor(
            EngineConfig(source=source), options),
        resolve=resolve, list_available=list)
    background.start()
    yield background
    background.stop()


def post(node, path, body):
    return httpx.post(node.url + path, json=body, timeout=20)


def expected_vector(text: str) -> list[float]:
    """What the fake engine returns for text, after the float32 trip over the wire."""
    ids = [2, *FakeTokenizer().encode(text), 3]
    return np.asarray(fake_vector(ids), dtype=np.float32).tolist()


def test_openai_float_and_base64(node):
    body = {"model": "embed-alias", "input": ["one two", "three"], "encoding_format": "float"}
    response = post(node, "/v1/embeddings", body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["object"] == "list" and result["model"] == "fake-embed"
    assert [d["index"] for d in result["data"]] == [0, 1]
    assert result["data"][0]["object"] == "embedding"
    assert result["data"][0]["embedding"] == expected_vector("one two")
    assert result["data"][1]["embedding"] == expected_vector("three")
    assert result["usage"] == {"prompt_tokens": 4 + 3, "total_tokens": 7}
    encoded = post(node, "/v1/embeddings", {**body, "encoding_format": "base64"}).json()
    for plain, packed in zip(result["data"], encoded["data"]):
        decoded = np.frombuffer(base64.b64decode(packed["embedding"]), dtype="<f4")
        assert decoded.tolist() == plain["embedding"]
    single = post(node, "/v1/embeddings", {"model": "fake-embed", "input": "three"}).json()
    assert single["data"][0]["embedding"] == expected_vector("three")


def test_openai_token_id_inputs_are_used_as_given(node):
    one = post(node, "/v1/embeddings", {"model": "fake-embed", "input": [5, 6, 7]}).json()
    many = post(node, "/v1/embeddings",
                {"model": "fake-embed", "input": [[5, 6, 7], [9]], "dimensions": 4}).json()
    vector = np.asarray(fake_vector([5, 6, 7]), dtype=np.float32).tolist()
    assert one["data"][0]["embedding"] == vector == many["data"][0]["embedding"]
    assert many["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize("body, status, param, code", [
    ({"input": []}, 400, "input", "invalid_parameter"),
    ({"input": ["a", ""]}, 400, "input", "invalid_parameter"),
    ({"input": [[1, 2], []]}, 400, "input", "invalid_parameter"),
    ({"input": ["x"] * 2049}, 400, "input", "invalid_parameter"),
    ({"input": [5, 5000]}, 400, "input", "invalid_request"),
    ({"input": "w " * MAX_MODEL_LEN}, 400, "input", "context_length_exceeded"),
    ({"input": "a", "encoding_format": "hex"}, 400, "encoding_format", "invalid_parameter"),
    ({"input": "a", "dimensions": 3}, 400, "dimensions", "invalid_parameter"),
    ({"input": "a", "dimensions": 0}, 400, "dimensions", "invalid_parameter"),
    ({"input": "a", "model": "nope"}, 404, "model", "model_not_found"),
    ({"input": "a", "model": "fake-model"}, 400, "model", "invalid_request"),
])
def test_openai_errors_name_the_parameter(node, body, status, param, code):
    response = post(node, "/v1/embeddings", {"model": "fake-embed", **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]
    assert error["param"] == param or error["param"].startswith(param)


def test_an_embedding_model_cannot_chat(node):
    response = post(node, "/v1/chat/completions",
                    {"model": "fake-embed", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"
    assert "embedding model" in response.json()["error"]["message"]


def test_ollama_embed(node):
    response = post(node, "/api/embed", {"model": "fake-embed:latest", "input": ["one two", "x"],
                                         "keep_alive": "5m"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"model", "embeddings", "total_duration", "load_duration",
                         "prompt_eval_count"}
    assert body["model"] == "fake-embed"
    assert body["embeddings"] == [expected_vector("one two"), expected_vector("x")]
    assert body["prompt_eval_count"] == 7
    assert body["total_duration"] >= body["load_duration"] >= 0
    single = post(node, "/api/embed", {"model": "fake-embed", "input": "x"}).json()
    assert single["embeddings"] == [expected_vector("x")]


def test_ollama_truncates_unless_told_not_to(node):
    long_text = "w " * (MAX_MODEL_LEN + 4)
    cut = post(node, "/api/embed", {"model": "fake-embed", "input": long_text}).json()
    assert cut["prompt_eval_count"] == MAX_MODEL_LEN
    refused = post(node, "/api/embed", {"model": "fake-embed", "input": long_text,
                                        "truncate": False})
    assert refused.status_code == 400
    assert "context length" in refused.json()["error"]


def test_ollama_empty_input_only_loads(node):
    body = post(node, "/api/embed", {"model": "fake-embed"}).json()
    assert body["embeddings"] == [] and body["prompt_eval_count"] == 0
    assert post(node, "/api/embeddings", {"model": "fake-embed"}).json() == {"embedding": []}


def test_ollama_legacy_embeddings(node):
    body = post(node, "/api/embeddings", {"model": "fake-embed", "prompt": "one two"}).json()
    assert body == {"embedding": expected_vector("one two")}


@pytest.mark.parametrize("path, body, status", [
    ("/api/embed", {"model": "nope", "input": "a"}, 404),
    ("/api/embed", {"model": "fake-model", "input": "a"}, 400),
    ("/api/embed", {"model": "fake-embed", "input": ["a", ""]}, 400),
    ("/api/embed", {"model": "fake-embed", "input": "a", "keep_alive": "soon"}, 400),
    ("/api/embed", {"model": "fake-embed", "input": "a", "dimensions": 7}, 400),
    ("/api/embed", {"input": "a"}, 400),
    ("/api/embeddings", {"model": "nope", "prompt": "a"}, 404),
    ("/api/embeddings", {"model": "fake-embed", "prompt": 5}, 400),
])
def test_ollama_errors(node, path, body, status):
    response = post(node, path, body)
    assert response.status_code == status, response.text
    error = response.json()
    assert set(error) == {"error"} and error["error"]
