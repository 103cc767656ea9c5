"""Canonical tensor names shared by the GGUF and safetensors readers, and stage filtering.

Global: embed.weight, norm.weight, lm_head.weight. Per layer i: layers.{i}.<part>.weight
(and .bias) with part one of attn_norm, q, k, v, o, q_norm, k_norm, post_attn_norm,
mlp_norm, post_mlp_norm, gate, up, down, sinks. Mixture-of-experts layers have router and, per
expert e, experts.{e}.gate / .up / .down (a GGUF file stores a layer's experts as one 3-D
tensor, experts.gate, which its reader splits by expert); qwen2moe's shared expert is
shared_expert.gate / .up / .down with its gate shared_expert_gate (GLM-4.5's and DeepSeek's
shared experts have none); sigmoid routers add router_score_bias.bias. Expert biases
(gpt-oss) are experts.{e}.gate / .up / .down .bias. A family may say that one of its tables'
tensor kinds is another part (ModelFamily.tensor_parts).

A family's GGUF and Hugging Face names come from the gguf package's tables for the family's
architecture (MODEL_TENSORS, TENSOR_NAMES, TensorNameMap); this module only says which of
its tensor kinds is which canonical part.
"""

from __future__ import annotations

import re

from gguf import (
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    MODEL_TENSOR,
    MODEL_TENSORS,
    TENSOR_NAMES,
    TensorNameMap,
)

from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.config import ModelConfig
from shoal.engine.models.families.family import ModelFamily

LayerRange = tuple[int, int]
CanonicalName = tuple[str | None, int | None]  # (name, layer index); (None, None): not used

_GLOBAL_PARTS = {
    MODEL_TENSOR.TOKEN_EMBD: "embed", MODEL_TENSOR.OUTPUT_NORM: "norm",
    MODEL_TENSOR.OUTPUT: "lm_head",
}
# In llama-style blocks the pre-MLP norm is FFN_NORM; Gemma's FFN_PRE_NORM is the same
# tensor in a GGUF file ("ffn_norm"), its post_attention_layernorm a true ATTN_POST_NORM.
_LAYER_PARTS = {
    MODEL_TENSOR.ATTN_NORM: "attn_norm", MODEL_TENSOR.ATTN_Q: "q", MODEL_TENSOR.ATTN_K: "k",
    MODEL_TENSOR.ATTN_V: "v", MODEL_TENSOR.ATTN_OUT: "o",
    MODEL_TENSOR.ATTN_Q_NORM: "q_norm", MODEL_TENSOR.ATTN_K_NORM: "k_norm",
    MODEL_TENSOR.ATTN_POST_NORM: "post_attn_norm", MODEL_TENSOR.FFN_NORM: "mlp_norm",
    MODEL_TENSOR.FFN_PRE_NORM: "mlp_norm", MODEL_TENSOR.FFN_POST_NORM: "post_mlp_norm",
    MODEL_TENSOR.FFN_GATE: "gate", MODEL_TENSOR.FFN_UP: "up", MODEL_TENSOR.FFN_DOWN: "down",
    # DeepSeek's latent attention (models/deepseek2.py): q straight (q) or through q_a,
    # q_a_norm, q_b; the kv latent and shared rope key (kv_a), its norm, and its per-head
    # decompression kv_b (newer GGUF files: k_b, transposed, and v_b, each [heads, ., .]).
    MODEL_TENSOR.ATTN_Q_A: "q_a", MODEL_TENSOR.ATTN_Q_B: "q_b",
    MODEL_TENSOR.ATTN_Q_A_NORM: "q_a_norm", MODEL_TENSOR.ATTN_KV_A_MQA: "kv_a",
    MODEL_TENSOR.ATTN_KV_A_NORM: "kv_a_norm", MODEL_TENSOR.ATTN_KV_B: "kv_b",
    MODEL_TENSOR.ATTN_K_B: "k_b", MODEL_TENSOR.ATTN_V_B: "v_b",
    # Mixture-of-experts layers.
    MODEL_TENSOR.FFN_GATE_INP: "router", MODEL_TENSOR.FFN_GATE_EXP: "experts.gate",
    MODEL_TENSOR.FFN_UP_EXP: "experts.up", MODEL_TENSOR.FFN_DOWN_EXP: "experts.down",
    MODEL_TENSOR.FFN_GATE_SHEXP: "shared_expert.gate",
    MODEL_TENSOR.FFN_UP_SHEXP: "shared_expert.up",
    MODEL_TENSOR.FFN_DOWN_SHEXP: "shared_expert.down",
    MODEL_TENSOR.FFN_GATE_INP_SHEXP: "shared_expert_gate",
    # The sigmoid routers' per-expert score bias (e_score_correction_bias; its GGUF name
    # ends in .bias).
    MODEL_TENSOR.FFN_EXP_PROBS_B: "router_score_bias",
    MODEL_TENSOR.ATTN_SINKS: "sinks",  # gpt-oss: one logit per head
}
_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# A Hugging Face checkpoint stores each expert's matrices apart: "...experts.5.gate_proj".
_HF_EXPERT = re.compile(r"\.experts\.(\d+)\.")


class TensorNames:
    """One family's GGUF and Hugging Face tensor names -> shoal's canonical names."""

    def __init__(self, family: ModelFamily, num_layers: int) -> None:
        if family.tensor_tables is None:
            raise UnsupportedModel(f"family {family.name!r} declares no tensor names")
        self.arch = _model_arch(family.tensor_tables)
        self.num_layers = num_layers
        kinds = MODEL_TENSORS[self.arch]
        # GGUF base name ("token_embd", or a block's "attn_q") -> canonical part.
        self._global = {TENSOR_NAMES[kind]: part for kind, part in _GLOBAL_PARTS.items()
                        if kind in kinds}
        layer_parts = _LAYER_PARTS | {MODEL_TENSOR[kind]: part
                                      for kind, part in family.tensor_parts.items()}
        self._layer = {TENSOR_NAMES[kind].removeprefix("blk.{bid}."): part
                       for kind, part in layer_parts.items() if kind in kinds}
        self._hf_map: TensorNameMap | None = None  # built on first from_hf

    def from_gguf(self, name: str) -> CanonicalName:
        """"blk.3.attn_q.weight" -> ("layers.3.q.weight", 3); "output.weight" ->
        ("lm_head.weight", None)."""
        if name.endswith(".weight") and name[:-7] in self._global:
            return f"{self._global[name[:-7]]}.weight", None
        match = _GGUF_BLOCK.match(name)
        if match is None or match.group(2) not in self._layer:
            return None, None
        layer = int(match.group(1))
        return f"layers.{layer}.{self._layer[match.group(2)]}.{match.group(3)}", layer

    def from_hf(self, name: str) -> CanonicalName:
        """"model.layers.3.self_attn.q_proj.weight" -> ("layers.3.q.weight", 3);
        "model.layers.3.mlp.experts.5.up_proj.weight" -> ("layers.3.experts.5.up.weight", 3)."""
        if self._hf_map is None:
            self._hf_map = TensorNameMap(self.arch, self.num_layers)
        # llama.cpp's converter renames the router's bias so the tables find it.
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        expert = _HF_EXPERT.search(name)
        if expert is not None:  # the gguf tables name the experts of a layer together
            name = name[:expert.start()] + ".experts." + name[expert.end():]
        found = self._hf_map.get_type_and_name(name, try_suffixes=(".weight", ".bias"))
        if found is None:
            return None, None
        canonical, layer = self.from_gguf(found[1])
        if expert is not None and canonical is not None:
            canonical = expert_name(canonical, int(expert.group(1)))
        return canonical, layer


def expert_name(canonical: str, expert: int) -> str:
    """"layers.3.experts.gate.weight" -> "layers.3.experts.{expert}.gate.weight"."""
    if ".experts." not in canonical:
        raise ValueError(f"{canonical} is not an expert tensor")
    return canonical.replace(".experts.", f".experts.{expert}.", 1)


def _model_arch(name: str) -> MODEL_ARCH:
    for arch, arch_name in MODEL_ARCH_NAMES.items():
        if arch_name == name:
            return arch
    raise UnsupportedModel(f"the gguf package has no tensor tables for {name!r}")


def check_layer_range(layer_range: LayerRange | None, num_layers: int) -> LayerRange:
    """The half-open range [start, end), defaulting to the whole model."""
    if layer_range is None:
        return 0, num_layers
    start, end = layer_range
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"layer range [{start}, {end}) is not within 0..{num_layers}")
    return start, end


def in_stage(name: str, layer: int | None, start: int, end: int, config: ModelConfig) -> bool:
    """Whether the stage holding layers [start, end) needs this tensor."""
    if layer is not None:
        return start <= layer < end
    first, last = start == 0, end == config.num_layers
    if name == "embed.weight":
        # The last stage of a tied model reuses the embedding as its output head.
        return first or (last and config.tie_embeddings)
    return last  # norm.weight, lm_head.weight
