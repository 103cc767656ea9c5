"""gpt-oss (gpt-oss-20b, gpt-oss-120b): the llama skeleton with biases on q/k/v/o, a learned
attention sink per head, sliding-window (128) and full layers alternating, YaRN RoPE, and
every MLP routed to experts (top-k of the router's logits, softmax over those k; experts
with biases and a clamped SwiGLU; MXFP4 weights in published files).

config.json checkpoints hold a layer's experts as two 3-D tensors with gate and up
interleaved (gate_up_proj [experts, hidden, 2 * size]: gate = [..., ::2], up = [..., 1::2])
and down_proj [experts, size, hidden], both as x @ W; split_hf_tensor turns them into the
per-expert [out, in] matrices and biases the gguf tables name. GGUF files (llama.cpp's
converter) already hold gate and up apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.config import YarnScaling
from shoal.engine.models.families.experts import gguf_expert_config, hf_expert_config
from shoal.engine.models.families.family import ModelFamily

DEFAULT_SLIDING_WINDOW = 128
# llama.cpp fixes the clamped SwiGLU's constants for this architecture (as transformers'
# GptOssConfig defaults do).
DEFAULT_SWIGLU_ALPHA = 1.702
DEFAULT_SWIGLU_LIMIT = 7.0
# gpt-oss's own YaRN settings (its config.json's), which GGUF files do not all carry.
DEFAULT_YARN = dict(factor=32.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0,
                    truncate=False)


def _alternating(num_layers: int) -> tuple[str, ...]:
    # Even layers slide, odd ones attend to everything (transformers' default layer_types,
    # llama.cpp's swa pattern 2).
    return tuple("sliding" if i % 2 == 0 else "full" for i in range(num_layers))


def _gguf_config(read: Callable[[str, Any], Any], common: dict[str, Any]) -> dict[str, Any]:
    # Every gpt-oss uses YaRN: a file that does not say so gets the model's own settings.
    scaling = read("rope.scaling.type", "yarn")
    if scaling != "yarn":
        raise UnsupportedModel(f"gpt-oss with RoPE scaling {scaling!r} is not supported")
    yarn = YarnScaling(
        factor=float(read("rope.scaling.factor", DEFAULT_YARN["factor"])),
        original_max_position=int(read("rope.scaling.original_context_length",
                                       DEFAULT_YARN["original_max_position"])),
        beta_fast=float(read("rope.scaling.yarn_beta_fast", DEFAULT_YARN["beta_fast"])),
        beta_slow=float(read("rope.scaling.yarn_beta_slow", DEFAULT_YARN["beta_slow"])),
        truncate=DEFAULT_YARN["truncate"])
    return dict(
        gguf_expert_config(read, common, norm_topk_prob=False),
        sliding_window=int(read("attention.sliding_window", DEFAULT_SLIDING_WINDOW)),
        layer_types=_alternating(common["num_layers"]),
        rope_yarn=yarn, rope_scaling_factor=1.0, **_EXPERT_STYLE)


def _hf_config(hf: Mapping[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    types = hf.get("layer_types")
    layer_types = (tuple("sliding" if t == "sliding_attention" else "full" for t in types)
                   if types else _alternating(common["num_layers"]))
    return dict(
        hf_expert_config(hf, common, expert_size_key="intermediate_size", norm_topk_prob=False),
        sliding_window=int(hf.get("sliding_window") or DEFAULT_SLIDING_WINDOW),
        layer_types=layer_types, rope_yarn=_hf_yarn(hf), rope_scaling_factor=1.0,
        swiglu_alpha=float(hf.get("swiglu_alpha", DEFAULT_SWIGLU_ALPHA)),
        swiglu_limit=float(hf.get("swiglu_limit", DEFAULT_SWIGLU_LIMIT)),
        router_softmax_after_topk=True)


_EXPERT_STYLE = dict(router_softmax_after_topk=True, swiglu_alpha=DEFAULT_SWIGLU_ALPHA,
                     swiglu_limit=DEFAULT_SWIGLU_LIMIT)


def _hf_yarn(hf: Mapping[str, Any]) -> YarnScaling | None:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise UnsupportedModel(f"gpt-oss with RoPE scaling {kind!r} is not supported")
    if rope.get("mscale") or rope.get("mscale_all_dim"):
        raise UnsupportedModel("YaRN with mscale is not supported")
    return YarnScaling(
        factor=float(rope["factor"]),
        original_max_position=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        truncate=bool(rope.get("truncate", True)),
        attention_factor=rope.get("attention_factor"))


def split_hf_tensor(name: str, load: Callable[[], Any]
                    ) -> list[tuple[str, Callable[[], Any]]] | None:
    """A config.json checkpoint's fused tensors as the tensors the gguf tables name: each
    expert's gate, up and down [out, in] and their biases, and the sinks as a weight; None
    for a tensor to read as it is. A fused tensor is read here, whichever layers the
    caller keeps (one layer's experts at a time)."""
    if name.endswith(("_blocks", "_scales")):
        raise UnsupportedModel("gpt-oss safetensors with MXFP4 expert blocks are not supported "
                               "yet: use its GGUF file, or dequantized weights")
    if name.endswith("self_attn.sinks"):
        return [(name + ".weight", load)]
    base, _, kind = name.rpartition(".experts.")
    if kind not in _EXPERT_PARTS:
        return None
    tensor = load()
    parts = []
    for e in range(tensor.shape[0]):
        for part, pick in _EXPERT_PARTS[kind]:
            parts.append((f"{base}.experts.{e}.{part}", partial(pick, tensor[e])))
    return parts


def _column_pick(offset: int):
    # gate_up_proj[e]: [hidden, 2 * size] as x @ W, gate and up interleaved -> [size, hidden]
    return lambda matrix: matrix[:, offset::2].t().contiguous()


def _bias_pick(offset: int):
    return lambda vector: vector[offset::2].contiguous()


# Each fused tensor's parts: (name after "experts.{e}.", value from the expert's slice).
_EXPERT_PARTS = {
    "gate_up_proj": (("gate_proj.weight", _column_pick(0)), ("up_proj.weight", _column_pick(1))),
    "gate_up_proj_bias": (("gate_proj.bias", _bias_pick(0)), ("up_proj.bias", _bias_pick(1))),
    "down_proj": (("down_proj.weight", lambda matrix: matrix.t().contiguous()),),
    "down_proj_bias": (("down_proj.bias", lambda vector: vector.contiguous()),),
}


GPT_OSS = ModelFamily(
    name="gpt-oss",
    model="shoal.engine.models.llama:LlamaModel",
    hf_architectures=("GptOssForCausalLM",),
    hf_model_types=("gpt_oss",),
    gguf_architectures=("gpt-oss",),
    tensor_tables="gpt-oss",
    supports_sliding_window=True,
    gguf_config_extras=_gguf_config,
    hf_config_extras=_hf_config,
    hf_tensor_split=split_hf_tensor,
    # gpt-oss files name its pre-MLP norm ATTN_POST_NORM ("post_attention_norm").
    tensor_parts={"ATTN_POST_NORM": "mlp_norm"},
    rope_scalings=("none", "yarn"),
)
