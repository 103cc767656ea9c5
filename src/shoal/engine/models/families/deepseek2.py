"""DeepSeek-V2 / V2-Lite / V2.5 and DeepSeek-V3 (llama.cpp's GGUF architecture "deepseek2"
covers both): multi-head latent attention (models/deepseek2.py), dense leading layers, then
routed experts plus always-on shared experts. V3 scores experts with a sigmoid and a
per-expert bias, V2 with a softmax (layers/experts.py GroupedRouter); both may keep each
token to its best groups of experts. YaRN RoPE with its attention scale.

Real V3 checkpoints carry a multi-token-prediction layer after the last decoder layer
(model.layers.{num_hidden_layers}); llama.cpp's converter drops it; shoal never reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.config import LatentAttention, YarnScaling
from shoal.engine.models.families.experts import (
    gguf_grouped_expert_config,
    hf_grouped_expert_config,
)
from shoal.engine.models.families.family import GGUF_CONFIG_KEYS, HF_CONFIG_KEYS, ModelFamily

_V3_NAMES = ("DeepseekV3ForCausalLM", "deepseek_v3")


def _softmax_scale(latent: LatentAttention, yarn: YarnScaling | None) -> float:
    # transformers' yarn_apply_mscale: with YaRN, logits scaled by mscale_all_dim's mscale
    # twice (the q and k halves of it).
    scale = latent.qk_head_dim ** (-0.5)
    if yarn is not None and yarn.mscale_all_dim:
        mscale = yarn.magnitude(yarn.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def _attention_fields(latent: LatentAttention, yarn: YarnScaling | None) -> dict[str, Any]:
    # Absorbed, the heads attend as multi-query attention: one KV head, the cached latent
    # row (ModelConfig.kv_cache_rows); head_dim is the query heads' nope + rope.
    return dict(latent_attention=latent, head_dim=latent.qk_head_dim, num_kv_heads=1,
                rope_yarn=yarn, rotary_dim=latent.qk_rope_head_dim,
                attention_scale=_softmax_scale(latent, yarn))


def gguf_config_extras(read: Callable[[str, Any], Any], common: dict[str, Any]) -> dict[str, Any]:
    rope = int(read("rope.dimension_count", 64))
    rank = int(read("attention.kv_lora_rank"))
    # Newer converters say the heads' sizes under *_mla (key_length is then the latent's);
    # older ones in key_length / value_length.
    mla_key = read("attention.key_length_mla", None)
    key = int(mla_key if mla_key is not None else read("attention.key_length"))
    value = int(read("attention.value_length_mla" if mla_key is not None
                     else "attention.value_length"))
    latent = LatentAttention(q_lora_rank=int(read("attention.q_lora_rank", 0) or 0),
                             kv_lora_rank=rank, qk_nope_head_dim=key - rope,
                             qk_rope_head_dim=rope, v_head_dim=value)
    yarn = None
    if read("rope.scaling.type", "none") == "yarn":
        log_multiplier = read("rope.scaling.yarn_log_multiplier", None)
        # The converter stores 0.1 * mscale_all_dim; DeepSeek's mscale equals it.
        mscale = None if log_multiplier is None else float(log_multiplier) / 0.1
        yarn = YarnScaling(factor=float(read("rope.scaling.factor")),
                           original_max_position=int(read("rope.scaling.original_context_length")),
                           beta_fast=float(read("rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=float(read("rope.scaling.yarn_beta_slow", 1.0)),
                           mscale=mscale, mscale_all_dim=mscale)
    values = gguf_grouped_expert_config(read, common, scoring="softmax")
    return values | _attention_fields(latent, yarn)


def hf_config_extras(hf: Mapping[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    if hf.get("attention_bias"):
        raise UnsupportedModel("DeepSeek attention with biases is not supported")
    latent = LatentAttention(q_lora_rank=int(hf.get("q_lora_rank") or 0),
                             kv_lora_rank=int(hf["kv_lora_rank"]),
                             qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
                             qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
                             v_head_dim=int(hf["v_head_dim"]))
    v3 = any(name in _V3_NAMES for name in (*(hf.get("architectures") or ()),
                                            hf.get("model_type")))
    scoring = hf.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    values = hf_grouped_expert_config(hf, scoring=scoring, norm_topk_prob=v3)
    if not v3 and hf.get("topk_method", "greedy") == "greedy":
        values |= dict(expert_groups=1, expert_groups_used=1)  # V2's groups unused
    return values | _attention_fields(latent, _hf_yarn(hf))


def _hf_yarn(hf: Mapping[str, Any]) -> YarnScaling | None:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind != "yarn":
        raise UnsupportedModel(f"RoPE scaling {kind!r} is not supported for DeepSeek")
    return YarnScaling(factor=float(rope["factor"]),
                       original_max_position=int(rope["original_max_position_embeddings"]),
                       beta_fast=float(rope.get("beta_fast") or 32.0),
                       beta_slow=float(rope.get("beta_slow") or 1.0),
                       mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"))


DEEPSEEK2 = ModelFamily(
    name="deepseek2",
    model="shoal.engine.models.deepseek2:DeepseekModel",
    hf_architectures=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
    hf_model_types=("deepseek_v2", "deepseek_v3"),
    gguf_architectures=("deepseek2",),
    tensor_tables="deepseek2",
    # The heads as the cluster's model facts count them: every query head has its key of
    # qk_nope + qk_rope dimensions (llama.cpp's newer files say one latent "head"); the
    # cache holds one row of kv_lora_rank + kv_rope_dim per token and layer.
    gguf_config_keys={**GGUF_CONFIG_KEYS, "num_kv_heads": "attention.head_count",
                      "head_dim": "attention.key_length_mla",
                      "kv_lora_rank": "attention.kv_lora_rank",
                      "kv_rope_dim": "rope.dimension_count"},
    hf_config_keys={**HF_CONFIG_KEYS, "head_dim": "qk_head_dim",
                    "kv_lora_rank": "kv_lora_rank", "kv_rope_dim": "qk_rope_head_dim"},
    rope_scalings=("none", "yarn"),
    gguf_config_extras=gguf_config_extras,
    hf_config_extras=hf_config_extras,
)
