"""POST /instances refuses expert sharding of a dense model with a clear 400."""

from __future__ import annotations

import httpx


def test_expert_sharding_of_a_dense_model_is_a_400(fake_node):
    weights = fake_node.config.data_dir / "fake-model.gguf"  # a dense llama-shaped file
    response = httpx.post(fake_node.url + "/instances", timeout=30,
                          json={"model": str(weights), "sharding": "expert"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "sharding"
    assert "expert sharding needs a mixture-of-experts model" in error["message"]
