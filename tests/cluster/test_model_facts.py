"""ModelFacts from a GGUF header or a config.json, without loading weights."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest

from shoal.cluster.model_facts import model_facts_from_source
from shoal.engine.config import ModelSource
from shoal.engine.errors import UnsupportedModel


def write_gguf(path, *, kv_heads: int | None = 2, key_length: int | None = None,
               experts: int | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), "qwen2")
    if experts is not None:
        writer.add_uint32("qwen2.expert_count", experts)
    writer.add_uint32("qwen2.block_count", 6)
    writer.add_uint32("qwen2.embedding_length", 96)
    writer.add_uint32("qwen2.feed_forward_length", 256)
    writer.add_uint32("qwen2.attention.head_count", 6)
    if kv_heads is not None:
        writer.add_uint32("qwen2.attention.head_count_kv", kv_heads)
    if key_length is not None:
        writer.add_uint32("qwen2.attention.key_length", key_length)
    writer.add_tensor("token_embd.weight", np.zeros((32, 96), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_header_gives_the_facts(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    facts = model_facts_from_source(ModelSource(model_id="m", format="gguf", path=path))
    assert (facts.model, facts.n_layers, facts.n_heads, facts.n_kv_heads) == ("m", 6, 6, 2)
    assert facts.head_dim == 96 // 6 and facts.intermediate_size == 256
    assert facts.weight_bytes == path.stat().st_size


def test_expert_counts_come_from_either_format(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, experts=8)
    facts = model_facts_from_source(ModelSource(model_id="m", format="gguf", path=path))
    assert facts.n_experts == 8
    dense = tmp_path / "dense.gguf"
    write_gguf(dense)
    assert model_facts_from_source(ModelSource("d", "gguf", dense)).n_experts == 0
    directory = tmp_path / "mixtral"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32,
        "num_local_experts": 8}))
    assert model_facts_from_source(ModelSource("x", "safetensors", directory)).n_experts == 8


def test_the_routed_experts_bytes_come_from_either_format(tmp_path):
    """What expert sharding splits: the 3-D *_exps tensors of a GGUF, the
    experts.N tensors of safetensors files (a shared expert is not among them)."""
    from engine import tiny_models  # tests/engine, a namespace package on tests/'s path

    moe = tiny_models.build("qwen2moe", tmp_path)
    gguf_facts = model_facts_from_source(ModelSource("m", "gguf", moe.gguf_path))
    hf_facts = model_facts_from_source(ModelSource("m", "safetensors", moe.safetensors_dir))
    # 2 layers x 8 experts x (gate, up, down) of 32 x 64: float32 in safetensors.
    assert hf_facts.expert_bytes == 2 * 8 * 3 * 32 * 64 * 4
    assert 0 < gguf_facts.expert_bytes < gguf_facts.weight_bytes
    assert 0 < hf_facts.expert_bytes < hf_facts.weight_bytes
    dense = tiny_models.build("qwen3", tmp_path)
    assert model_facts_from_source(ModelSource("d", "gguf", dense.gguf_path)).expert_bytes == 0


def test_gguf_defaults_kv_heads_to_heads_and_honours_key_length(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, kv_heads=None, key_length=32)
    facts = model_facts_from_source(ModelSource(model_id="m", format="gguf", path=path))
    assert facts.n_kv_heads == 6 and facts.head_dim == 32


def test_reading_facts_does_not_import_torch(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    code = ("import sys; from pathlib import Path; "
            "from shoal.cluster.model_facts import model_facts_from_source; "
            "from shoal.engine.config import ModelSource; "
            f"model_facts_from_source(ModelSource('m', 'gguf', Path({str(path)!r}))); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_safetensors_config_gives_the_facts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64,
        "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 128}))
    (tmp_path / "model-1.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "model-2.safetensors").write_bytes(b"x" * 234)
    facts = model_facts_from_source(ModelSource(model_id="org/m", format="safetensors",
                                                path=tmp_path))
    assert (facts.n_layers, facts.n_heads, facts.n_kv_heads, facts.head_dim) == (4, 8, 4, 8)
    assert facts.weight_bytes == 1234 and facts.intermediate_size == 128


def test_multimodal_config_reads_the_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {
        "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}}))
    (tmp_path / "w.safetensors").write_bytes(b"")
    facts = model_facts_from_source(ModelSource(model_id="m", format="safetensors", path=tmp_path))
    assert (facts.n_layers, facts.n_kv_heads, facts.head_dim) == (3, 4, 32)


def test_incomplete_config_is_unsupported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(UnsupportedModel, match="num_attention_heads"):
        model_facts_from_source(ModelSource(model_id="m", format="safetensors", path=tmp_path))


def test_glm_and_deepseek_facts_count_their_experts_layers_and_cache_heads(tmp_path):
    # GLM-4.5's block_count counts its multi-token-prediction layer, which never runs.
    path = tmp_path / "glm.gguf"
    writer = gguf.GGUFWriter(str(path), "glm4moe")
    for key, value in (("block_count", 47), ("nextn_predict_layers", 1), ("expert_count", 128),
                       ("embedding_length", 4096), ("attention.head_count", 96),
                       ("attention.head_count_kv", 8), ("attention.key_length", 128)):
        writer.add_uint32(f"glm4moe.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((32, 96), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    facts = model_facts_from_source(ModelSource("glm", "gguf", path))
    assert (facts.n_layers, facts.n_experts, facts.n_kv_heads) == (46, 128, 8)
    # DeepSeek's files say one latent KV head; shoal caches one latent row per token and
    # layer: the 512 latent and the 64 rope key, in place of 128 heads' keys and values.
    path = tmp_path / "deepseek.gguf"
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    for key, value in (("block_count", 61), ("expert_count", 256), ("embedding_length", 7168),
                       ("attention.head_count", 128), ("attention.head_count_kv", 1),
                       ("attention.key_length", 576), ("attention.key_length_mla", 192),
                       ("attention.kv_lora_rank", 512), ("rope.dimension_count", 64)):
        writer.add_uint32(f"deepseek2.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((32, 96), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    facts = model_facts_from_source(ModelSource("ds", "gguf", path))
    assert (facts.n_layers, facts.n_experts, facts.n_kv_heads, facts.head_dim) == \
        (61, 256, 128, 192)
    assert facts.kv_latent_dim == 576
    assert facts.kv_bytes_per_token_per_layer(2) == 576 * 2
    assert facts.kv_bytes_per_token_per_layer(1, scale_bytes=2) == 576 + 2 * 576 // 16
    for architecture, extra in (("Glm4MoeForCausalLM", {"head_dim": 128}),
                                ("DeepseekV3ForCausalLM", {"qk_head_dim": 192,
                                                           "kv_lora_rank": 512,
                                                           "qk_rope_head_dim": 64})):
        directory = tmp_path / architecture
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({
            "architectures": [architecture], "num_hidden_layers": 46, "hidden_size": 4096,
            "num_attention_heads": 96, "num_key_value_heads": 8, "intermediate_size": 10944,
            "n_routed_experts": 128, **extra}))
        facts = model_facts_from_source(ModelSource("x", "safetensors", directory))
        assert facts.n_experts == 128 and facts.head_dim == next(iter(extra.values()))
        assert facts.kv_latent_dim == (576 if "kv_lora_rank" in extra else 0)
