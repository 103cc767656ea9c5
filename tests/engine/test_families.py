"""The family declarations: names are unambiguous, and every table a declaration names exists."""

from __future__ import annotations

import pytest

from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.registry import (
    FAMILIES,
    encoder_loader,
    family_of,
    find_family,
    model_class,
    task_of_hf_config,
)
from shoal.engine.weights.names import TensorNames, expert_name


def test_every_architecture_name_finds_its_family():
    for family in FAMILIES:
        for name in (family.name, *family.names):
            assert find_family(name) is family


def test_an_unknown_architecture_is_unsupported_and_named():
    assert find_family("mamba") is None
    with pytest.raises(UnsupportedModel, match="mamba"):
        family_of("mamba")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_the_model_a_family_names_imports(family):
    load = model_class if family.task == "generate" else encoder_loader
    assert callable(load(family))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.tensor_tables],
                         ids=lambda family: family.name)
def test_gguf_and_hugging_face_names_meet_at_the_same_canonical_name(family):
    names = TensorNames(family, num_layers=2)
    hf_to_gguf = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.layers.1.self_attn.q_proj.weight": "blk.1.attn_q.weight",
        "model.layers.1.self_attn.q_proj.bias": "blk.1.attn_q.bias",
    }
    if family.name not in EXPERT_ONLY_FAMILIES:
        hf_to_gguf["model.layers.1.mlp.down_proj.weight"] = "blk.1.ffn_down.weight"
    for hf_name, gguf_name in hf_to_gguf.items():
        assert names.from_hf(hf_name) == names.from_gguf(gguf_name) != (None, None)


# Families whose every layer routes to experts: their tables have no dense MLP.
EXPERT_ONLY_FAMILIES = ("qwen3moe", "qwen2moe", "gpt-oss")


@pytest.mark.parametrize("family", ("qwen3moe", "qwen2moe"))
def test_expert_names_meet_at_one_canonical_name_per_expert(family):
    # A GGUF file holds a layer's experts as one 3-D tensor, which its reader splits
    # (expert_name); a Hugging Face checkpoint holds each expert's matrices apart.
    names = TensorNames(family_of(family), num_layers=2)
    assert names.from_gguf("blk.1.ffn_down_exps.weight") == ("layers.1.experts.down.weight", 1)
    assert expert_name("layers.1.experts.down.weight", 5) == "layers.1.experts.5.down.weight"
    assert names.from_hf("model.layers.1.mlp.experts.5.down_proj.weight") == (
        "layers.1.experts.5.down.weight", 1)
    assert names.from_hf("model.layers.1.mlp.gate.weight") == names.from_gguf(
        "blk.1.ffn_gate_inp.weight") == ("layers.1.router.weight", 1)


def test_mixtral_names_its_experts_w1_w2_w3():
    names = TensorNames(family_of("mixtral"), num_layers=2)
    for hf_part, part in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
        assert names.from_hf(f"model.layers.1.block_sparse_moe.experts.5.{hf_part}.weight") \
            == (f"layers.1.experts.5.{part}.weight", 1)
    assert names.from_hf("model.layers.1.block_sparse_moe.gate.weight") == (
        "layers.1.router.weight", 1)


def test_qwen2moe_names_its_shared_expert_and_gate():
    names = TensorNames(family_of("qwen2moe"), num_layers=2)
    assert names.from_hf("model.layers.1.mlp.shared_expert.up_proj.weight") == names.from_gguf(
        "blk.1.ffn_up_shexp.weight") == ("layers.1.shared_expert.up.weight", 1)
    assert names.from_hf("model.layers.1.mlp.shared_expert_gate.weight") == names.from_gguf(
        "blk.1.ffn_gate_inp_shexp.weight") == ("layers.1.shared_expert_gate.weight", 1)


def test_gpt_oss_names_its_sinks_router_bias_and_fused_experts():
    import torch

    from shoal.engine.models.families.gptoss import split_hf_tensor

    names = TensorNames(family_of("gpt-oss"), num_layers=2)
    pairs = {"model.layers.1.self_attn.sinks.weight": "blk.1.attn_sinks.weight",
             "model.layers.1.mlp.router.bias": "blk.1.ffn_gate_inp.bias",
             "model.layers.1.self_attn.o_proj.bias": "blk.1.attn_output.bias",
             # its pre-MLP norm is ATTN_POST_NORM in GGUF files, the MLP's norm all the same
             "model.layers.1.post_attention_layernorm.weight": "blk.1.post_attention_norm.weight"}
    for hf_name, gguf_name in pairs.items():
        assert names.from_hf(hf_name) == names.from_gguf(gguf_name) != (None, None)
    assert names.from_gguf("blk.1.post_attention_norm.weight")[0] == "layers.1.mlp_norm.weight"
    # [experts, hidden, 2 * size], gate and up interleaved, as x @ W -> per expert [out, in]
    fused = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    parts = dict(split_hf_tensor("model.layers.1.mlp.experts.gate_up_proj", lambda: fused))
    gate = parts["model.layers.1.mlp.experts.1.gate_proj.weight"]()
    up = parts["model.layers.1.mlp.experts.1.up_proj.weight"]()
    assert torch.equal(gate, fused[1][:, 0::2].t()) and torch.equal(up, fused[1][:, 1::2].t())
    assert names.from_hf("model.layers.1.mlp.experts.1.up_proj.weight") == (
        "layers.1.experts.1.up.weight", 1)
    assert split_hf_tensor("model.layers.1.self_attn.q_proj.weight", lambda: fused) is None


def test_gemma_post_attention_norm_is_not_the_mlp_norm():
    # The same config.json name means the pre-MLP norm in llama-style blocks.
    name = "model.layers.0.post_attention_layernorm.weight"
    gemma, llama = TensorNames(family_of("gemma3"), 1), TensorNames(family_of("llama"), 1)
    assert gemma.from_hf(name) == ("layers.0.post_attn_norm.weight", 0)
    assert llama.from_hf(name) == ("layers.0.mlp_norm.weight", 0)


def test_task_of_a_config_json_follows_its_family():
    assert task_of_hf_config({"architectures": ["BertModel"]}) == "embed"
    assert task_of_hf_config({"model_type": "qwen2"}) == "generate"
    assert task_of_hf_config({"architectures": ["SomethingNew"]}) == "generate"
