"""Diffusers pipelines as models: a local pipeline directory, a Hugging Face cache snapshot
and a pulled repository resolve as image models; their weight bytes and placement facts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.catalog.pull.huggingface import diffusers_pipeline_files
from shoal.catalog.pull.puller import Puller
from shoal.catalog.pull.settings import PullSettings
from shoal.catalog.resolve import resolve_model
from shoal.cluster.model_facts import model_facts_from_source
from shoal.diffusion.files import pipeline_weight_bytes, weights_variant
from shoal.engine.config import ModelSource

INDEX = {"_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.31.0",
         "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
         "tokenizer": ["transformers", "CLIPTokenizer"],
         "safety_checker": [None, None]}
# A repository's files: plain and fp16 weights for the UNet, only .bin for the VAE.
FILES = {"model_index.json": json.dumps(INDEX).encode(),
         "unet/config.json": b"{}",
         "unet/diffusion_pytorch_model.safetensors": b"u" * 300,
         "unet/diffusion_pytorch_model.fp16.safetensors": b"h" * 150,
         "vae/config.json": b"{}",
         "vae/diffusion_pytorch_model.bin": b"v" * 40,
         "tokenizer/vocab.json": b"{}", "tokenizer/merges.txt": b"#version: 0.2\n",
         "README.md": b"not wanted", "unet/diffusion_pytorch_model.onnx": b"not wanted"}


def write_pipeline(directory: Path, files: dict[str, bytes] = FILES) -> Path:
    for name, data in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    return directory


def test_a_local_pipeline_directory_is_an_image_model(tmp_path):
    directory = write_pipeline(tmp_path / "tiny-sd")
    source = resolve_model(str(directory), catalog=(), data_dir=tmp_path / "data")
    assert (source.model_id, source.format, source.task) == ("tiny-sd", "diffusers", "image")
    assert source.path == directory


def test_a_pipeline_in_the_hugging_face_cache_is_an_image_model(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    write_pipeline(hub / "models--acme--tiny-sd" / "snapshots" / "abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    source = resolve_model("acme/tiny-sd", catalog=(), data_dir=tmp_path / "data")
    assert (source.model_id, source.format, source.task) == ("acme/tiny-sd", "diffusers",
                                                              "image")


def test_weight_bytes_count_what_diffusers_loads(tmp_path):
    directory = write_pipeline(tmp_path / "tiny-sd")
    # The UNet's plain safetensors (not its fp16 variant), the VAE's .bin.
    assert pipeline_weight_bytes(directory) == 300 + 40
    facts = model_facts_from_source(ModelSource("tiny-sd", "diffusers", directory, task="image"))
    assert facts.weight_bytes == 340 and facts.n_layers == 1


def test_a_pipeline_with_only_variant_weights_loads_that_variant(tmp_path):
    assert weights_variant(write_pipeline(tmp_path / "plain")) is None
    only_fp16 = {n: d for n, d in FILES.items() if n != "unet/diffusion_pytorch_model.safetensors"}
    directory = write_pipeline(tmp_path / "fp16", only_fp16)
    assert weights_variant(directory) == "fp16"
    assert pipeline_weight_bytes(directory) == 150 + 40


def test_an_image_source_is_a_diffusers_directory_and_nothing_else(tmp_path):
    directory = write_pipeline(tmp_path / "tiny-sd")
    with pytest.raises(ValueError, match="diffusers"):
        ModelSource("tiny-sd", "safetensors", directory, task="image")
    with pytest.raises(ValueError, match="diffusers"):
        ModelSource("tiny-sd", "diffusers", directory)


def test_a_pull_takes_the_pipelines_configs_tokenizer_and_plain_weights():
    assert diffusers_pipeline_files(FILES) == [
        "model_index.json", "tokenizer/merges.txt", "tokenizer/vocab.json", "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors", "vae/config.json"]
    only_fp16 = {n: d for n, d in FILES.items() if n != "unet/diffusion_pytorch_model.safetensors"}
    assert "unet/diffusion_pytorch_model.fp16.safetensors" in diffusers_pipeline_files(only_fp16)


def test_a_pulled_pipeline_resolves_as_an_image_model(hub_env, tmp_path):
    hub_env.add_hf_repo("acme/tiny-sd", FILES)
    puller = Puller(tmp_path / "data", PullSettings(connect_timeout_s=2, read_timeout_s=5),
                    catalog=(), free_bytes=lambda _path: 10**12, keep=lambda _entry: False)
    pulled = puller.pull("acme/tiny-sd")
    source = resolve_model("acme/tiny-sd", catalog=(), data_dir=tmp_path / "data")
    assert (source.format, source.task, source.path) == ("diffusers", "image", pulled.path)
    assert (source.path / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() == \
        FILES["unet/diffusion_pytorch_model.safetensors"]
    assert not (source.path / "unet" / "diffusion_pytorch_model.fp16.safetensors").exists()
