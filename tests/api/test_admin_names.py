"""POST /instances names a model as requests do: a model this node was given by path is
known by its id (the file's stem) from then on, on this node as on the others."""

from __future__ import annotations

import httpx
from fakes import write_fake_gguf


def test_a_model_given_by_path_is_placed_again_by_its_id(fake_node, tmp_path):
    weights = tmp_path / "given-by-path.gguf"
    write_fake_gguf(weights)
    unknown = httpx.post(fake_node.url + "/instances", timeout=30,
                         json={"model": "given-by-path"})
    assert unknown.status_code == 404, unknown.text  # not yet: nothing named it here
    placed = []
    for name in (str(weights), "given-by-path"):
        response = httpx.post(fake_node.url + "/instances", timeout=30, json={"model": name})
        assert response.status_code == 201, response.text
        assert response.json()["model"] == "given-by-path"
        placed.append(response.json()["instance_id"])
    for instance_id in placed:
        assert httpx.delete(f"{fake_node.url}/instances/{instance_id}",
                            timeout=30).status_code == 200
