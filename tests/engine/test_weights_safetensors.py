"""HF directories: config.json -> ModelConfig and the canonical tensor stream."""

from __future__ import annotations

import json

import pytest
import torch

from shoal.engine.errors import UnsupportedModel
from shoal.engine.weights.safetensors import SafetensorsCheckpoint, config_from_hf


def test_config_json_becomes_model_config(tiny_checkpoints):
    config = SafetensorsCheckpoint(tiny_checkpoints["gemma3"].safetensors_dir).config
    assert config.architecture == "gemma3" and config.sliding_window == 5
    assert config.rope_theta == 1_000_000.0 and config.rope_local_theta == 10_000.0
    assert config.attention_scale == pytest.approx(32 ** -0.5)
    qwen2 = SafetensorsCheckpoint(tiny_checkpoints["qwen2"].safetensors_dir).config
    assert qwen2.qkv_bias and qwen2.tie_embeddings


def test_gemma_norms_get_their_plus_one(tiny_checkpoints):
    tiny = tiny_checkpoints["gemma3"]
    weights = dict(SafetensorsCheckpoint(tiny.safetensors_dir).stream())
    hf_norm = tiny.hf_model.model.layers[0].input_layernorm.weight
    torch.testing.assert_close(weights["layers.0.attn_norm.weight"].dequantize(), hf_norm + 1)


def test_llama_post_attention_norm_is_the_mlp_norm(tiny_checkpoints):
    tiny = tiny_checkpoints["llama"]
    weights = dict(SafetensorsCheckpoint(tiny.safetensors_dir).stream((1, 2)))
    assert "layers.1.mlp_norm.weight" in weights and "layers.0.q.weight" not in weights
    assert "lm_head.weight" in weights and "embed.weight" not in weights


def test_unknown_architecture_is_unsupported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel"):
        SafetensorsCheckpoint(tmp_path)


def test_unsupported_rope_scaling_is_refused():
    hf = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "hidden_size": 64,
          "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 32,
          "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(UnsupportedModel, match="yarn"):
        config_from_hf(hf)
