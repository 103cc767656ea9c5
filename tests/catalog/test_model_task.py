"""Resolving a model also says what it does: generate text or produce embeddings."""

from __future__ import annotations

import json

import pytest

from shoal.catalog.resolve import resolve_model
from shoal.engine.config import ModelSource


def test_catalogue_kind_decides_the_task():
    assert resolve_model("all-minilm").task == "embed"
    assert resolve_model("sentence-transformers/all-MiniLM-L6-v2").task == "embed"
    assert resolve_model("smollm2").task == "generate"


@pytest.mark.parametrize("architecture, task", [("BertModel", "embed"),
                                                ("LlamaForCausalLM", "generate"),
                                                ("SomethingNew", "generate")])
def test_a_directory_task_comes_from_its_config(tmp_path, architecture, task):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model(str(tmp_path)).task == task


def test_embedding_sources_must_be_directories(tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"fake")
    with pytest.raises(ValueError, match="safetensors"):
        ModelSource("bert", "gguf", weights, task="embed")
