"""Tiny random-weight checkpoints of each family, saved as an HF safetensors directory and
as a GGUF file, with the transformers model that serves as the fp32 reference."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "mixtral", "gemma3")
MOE_FAMILIES = ("qwen3moe", "qwen2moe", "mixtral")
DENSE_FAMILIES = tuple(f for f in FAMILIES if f not in MOE_FAMILIES)
VOCAB = 128
# llama.cpp writes Mixtral as "llama" (with experts), its q/k rows permuted as llama's.
_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3moe",
              "qwen2moe": "qwen2moe", "mixtral": "llama", "gemma3": "gemma3",
              "gpt-oss": "gpt-oss"}
_PERMUTED_QK = ("llama", "mixtral")
# The mixture-of-experts shape: 8 experts of 32, 2 chosen per token.
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


@dataclass
class TinyCheckpoint:
    family: str
    hf_model: torch.nn.Module   # reference whose weights equal the safetensors files
    safetensors_dir: Path
    gguf_path: Path
    gguf_reference: torch.nn.Module  # reference with the GGUF's (dequantized) weights


def hf_config(family: str, **overrides):
    """The family's tiny config; overrides replace its shape (heads, head_dim, ...)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6,
                  tie_word_embeddings=family not in ("llama", "mixtral", "gpt-oss"))
    common.update(overrides)
    if family == "llama":
        return tf.LlamaConfig(num_hidden_layers=2, rope_theta=10000.0, **common)
    if family == "qwen2":
        return tf.Qwen2Config(num_hidden_layers=2, rope_theta=10000.0, **common)
    if family == "qwen3":
        return tf.Qwen3Config(num_hidden_layers=2, head_dim=32, rope_theta=10000.0, **common)
    if family == "qwen3moe":
        return tf.Qwen3MoeConfig(num_hidden_layers=2, head_dim=32, rope_theta=10000.0,
                                 norm_topk_prob=True, **(EXPERTS | common))
    if family == "qwen2moe":  # top-k weights not renormalised, as Qwen1.5-MoE's
        return tf.Qwen2MoeConfig(num_hidden_layers=2, rope_theta=10000.0,
                                 shared_expert_intermediate_size=64, **(EXPERTS | common))
    if family == "mixtral":  # every expert is intermediate_size wide
        common.update(intermediate_size=EXPERTS["moe_intermediate_size"])
        return tf.MixtralConfig(num_hidden_layers=2, rope_theta=10000.0, sliding_window=None,
                                num_local_experts=EXPERTS["num_experts"],
                                num_experts_per_tok=EXPERTS["num_experts_per_tok"], **common)
    if family == "gpt-oss":
        # Four layers, sliding and full alternating, a window of 8 tokens; 8 experts of 32,
        # 2 chosen; YaRN over an original context of 64 (interpolated and extrapolated
        # frequencies both present at head_dim 16).
        common.update(intermediate_size=EXPERTS["moe_intermediate_size"], rms_norm_eps=1e-5)
        return tf.GptOssConfig(
            num_hidden_layers=4, head_dim=16, sliding_window=8,
            num_local_experts=EXPERTS["num_experts"],
            num_experts_per_tok=EXPERTS["num_experts_per_tok"],
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                 original_max_position_embeddings=64, beta_fast=32.0,
                                 beta_slow=1.0, truncate=False), **common)
    # Six layers so both kinds appear (five sliding, one global); a window of 5 tokens.
    common.update(num_key_value_heads=1)
    return tf.Gemma3TextConfig(num_hidden_layers=6, head_dim=32, sliding_window=5,
                               query_pre_attn_scalar=32, **common)


def hf_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    config = hf_config(family, **overrides)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the plain per-expert loop
    classes = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
               "qwen3": tf.Qwen3ForCausalLM, "qwen3moe": tf.Qwen3MoeForCausalLM,
               "qwen2moe": tf.Qwen2MoeForCausalLM, "mixtral": tf.MixtralForCausalLM,
               "gemma3": tf.Gemma3ForCausalLM, "gpt-oss": tf.GptOssForCausalLM}
    model = classes[family](config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Random norms and biases too, so a misplaced norm or bias shows in the logits.
            std = 0.3 if "norm" in name or "bias" in name else 0.08
            if name.endswith(("sinks", "experts.gate_up_proj")):
                # Sinks that matter; gate/up large enough that the clamps of gpt-oss's
                # SwiGLU (at +-7) take part.
                std = 2.0 if name.endswith("sinks") else 0.6
            param.normal_(1.0 if ("norm" in name and family != "gemma3") else 0.0, std)
    return model


def build(family: str, directory: Path, metadata: dict | None = None,
          **overrides) -> TinyCheckpoint:
    """metadata: more GGUF keys (a tokenizer's, say) written into the file."""
    model = hf_model(family, **overrides)
    st_dir = directory / f"{family}-hf"
    model.save_pretrained(st_dir, safe_serialization=True)
    gguf_path = directory / f"{family}.gguf"
    dequantized = write_gguf(model, family, gguf_path, metadata)
    reference = hf_model(family, **overrides)
    reference.load_state_dict(dequantized, strict=False)
    if reference.config.tie_word_embeddings:
        reference.tie_weights()
    return TinyCheckpoint(family, model, st_dir, gguf_path, reference)


# HF parameter suffix -> (GGUF name, quantization used in the tiny file).
_LAYER_MAP = {
    "input_layernorm.weight": ("attn_norm.weight", "F32"),
    "self_attn.q_proj.weight": ("attn_q.weight", "Q4_1"),
    "self_attn.k_proj.weight": ("attn_k.weight", "Q4_1"),
    "self_attn.v_proj.weight": ("attn_v.weight", "Q8_0"),
    "self_attn.o_proj.weight": ("attn_output.weight", "Q4_0"),
    "self_attn.q_proj.bias": ("attn_q.bias", "F32"),
    "self_attn.k_proj.bias": ("attn_k.bias", "F32"),
    "self_attn.v_proj.bias": ("attn_v.bias", "F32"),
    "self_attn.o_proj.bias": ("attn_output.bias", "F32"),
    "self_attn.sinks": ("attn_sinks.weight", "F32"),
    "mlp.router.weight": ("ffn_gate_inp.weight", "F32"),
    "mlp.router.bias": ("ffn_gate_inp.bias", "F32"),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", "F32"),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", "F32"),
    "mlp.gate_proj.weight": ("ffn_gate.weight", "Q4_1"),
    "mlp.up_proj.weight": ("ffn_up.weight", "Q4_1"),
    "mlp.down_proj.weight": ("ffn_down.weight", "F16"),
    # Mixture of experts: transformers holds a layer's experts as 3-D tensors, gate and up
    # concatenated ([experts, 2 * size, hidden]); GGUF as three 3-D tensors.
    "mlp.gate.weight": ("ffn_gate_inp.weight", "F32"),
    "mlp.experts.down_proj": ("ffn_down_exps.weight", "Q8_0"),
    "mlp.shared_expert.gate_proj.weight": ("ffn_gate_shexp.weight", "Q4_1"),
    "mlp.shared_expert.up_proj.weight": ("ffn_up_shexp.weight", "Q8_0"),
    "mlp.shared_expert.down_proj.weight": ("ffn_down_shexp.weight", "Q4_0"),
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp.weight", "F32"),
    "pre_feedforward_layernorm.weight": ("ffn_norm.weight", "F32"),
    "post_feedforward_layernorm.weight": ("post_ffw_norm.weight", "F32"),
}


def _gguf_name(hf_name: str, family: str) -> tuple[str, str]:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight", "Q8_0"
    if hf_name == "model.norm.weight":
        return "output_norm.weight", "F32"
    if hf_name == "lm_head.weight":
        return "output.weight", "Q8_0"
    _, _, index, suffix = hf_name.split(".", 3)
    if suffix == "post_attention_layernorm.weight":
        part = ("post_attention_norm.weight" if family in ("gemma3", "gpt-oss")
                else "ffn_norm.weight")
        return f"blk.{index}.{part}", "F32"
    part, quant = _LAYER_MAP[suffix]
    return f"blk.{index}.{part}", quant


def write_gguf(model, family: str, path: Path,
               metadata: dict | None = None) -> dict[str, torch.Tensor]:
    """Write `model` as GGUF the way llama.cpp's converter would; returns the HF state dict
    of the values the file actually holds (after quantization)."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), _GGUF_ARCH[family])
    _write_metadata(writer, config, family)
    for key, value in (metadata or {}).items():
        _write_value(writer, key, value)
    stored: dict[str, torch.Tensor] = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if family == "gpt-oss" and ".mlp.experts." in hf_name:
            stored[hf_name] = _write_gpt_oss_experts(writer, hf_name, tensor)
            continue
        if hf_name.endswith("mlp.experts.gate_up_proj"):
            stored[hf_name] = _write_gate_up_experts(writer, hf_name, tensor)
            continue
        name, quant = _gguf_name(hf_name, family)
        values = tensor.float().numpy().copy()
        if family == "gemma3" and "norm" in name:
            values = values + 1.0  # GGUF Gemma norms hold 1 + w
        if family in _PERMUTED_QK and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            values = _permute(values, heads)
        data, back = _encode(values, quant)
        writer.add_tensor(name, data, raw_dtype=getattr(gguf.GGMLQuantizationType, quant))
        if family in _PERMUTED_QK and (".attn_q." in name or ".attn_k." in name):
            back = _unpermute(back, heads)
        if family == "gemma3" and "norm" in name:
            back = back - 1.0
        stored[hf_name] = torch.from_numpy(back.astype(np.float32)).reshape(tensor.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


# Gate and up experts in different packed types, as llama.cpp's mixes give them.
_EXPERT_GATE_UP = (("ffn_gate_exps.weight", "Q4_1"), ("ffn_up_exps.weight", "Q4_0"))


def _write_gate_up_experts(writer, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Writes [experts, 2 * size, hidden] as GGUF's gate and up expert tensors; returns the
    values they hold, concatenated back."""
    import gguf

    index = hf_name.split(".")[2]
    halves = tensor.float().numpy().copy().reshape(tensor.shape[0], 2, -1, tensor.shape[2])
    back = []
    for half, (part, quant) in enumerate(_EXPERT_GATE_UP):
        data, values = _encode(np.ascontiguousarray(halves[:, half]), quant)
        writer.add_tensor(f"blk.{index}.{part}", data,
                          raw_dtype=getattr(gguf.GGMLQuantizationType, quant))
        back.append(values.astype(np.float32))
    return torch.from_numpy(np.concatenate(back, axis=1)).reshape(tensor.shape)


def _write_gpt_oss_experts(writer, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """gpt-oss's fused experts as llama.cpp's converter writes them: gate and up taken
    apart from their interleaved columns, every matrix [experts, out, in] in MXFP4, biases
    [experts, out] in F32. Returns the values the file holds in transformers' layout."""
    import gguf

    index, kind = hf_name.split(".")[2], hf_name.rsplit(".", 1)[1]
    values = tensor.float().numpy().copy()
    if kind == "down_proj":  # [experts, size, hidden] (x @ W) -> [experts, hidden, size]
        data, back = _encode(np.ascontiguousarray(values.transpose(0, 2, 1)), "MXFP4")
        writer.add_tensor(f"blk.{index}.ffn_down_exps.weight", data,
                          raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        return torch.from_numpy(np.ascontiguousarray(back.transpose(0, 2, 1)))
    if kind == "down_proj_bias":
        writer.add_tensor(f"blk.{index}.ffn_down_exps.bias", values)
        return torch.from_numpy(values)
    back = np.empty_like(values)
    for offset, part in ((0, "gate"), (1, "up")):
        if kind == "gate_up_proj":  # [experts, hidden, 2 * size], gate and up interleaved
            matrix = np.ascontiguousarray(values[:, :, offset::2].transpose(0, 2, 1))
            data, held = _encode(matrix, "MXFP4")
            writer.add_tensor(f"blk.{index}.ffn_{part}_exps.weight", data,
                              raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            back[:, :, offset::2] = held.transpose(0, 2, 1)
        else:  # gate_up_proj_bias [experts, 2 * size]
            bias = np.ascontiguousarray(values[:, offset::2])
            writer.add_tensor(f"blk.{index}.ffn_{part}_exps.bias", bias)
            back[:, offset::2] = bias
    return torch.from_numpy(back)


def _write_value(writer, key: str, value) -> None:
    if key == "general.architecture":
        return  # the writer's own
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


def _encode(values: np.ndarray, quant: str) -> tuple[np.ndarray, np.ndarray]:
    import gguf

    if quant == "F32":
        return values.astype(np.float32), values.astype(np.float32)
    if quant == "F16":
        half = values.astype(np.float16)
        return half, half.astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    data = gguf.quants.quantize(values.astype(np.float32), qtype)
    return data, gguf.quants.dequantize(data, qtype).reshape(values.shape)


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf: interleave each head's two rotary halves.
    rows = weights.shape[0]
    return (weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    rows = weights.shape[0]
    return (weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _write_metadata(writer, config, family: str) -> None:
    arch = _GGUF_ARCH[family]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_uint32(f"{arch}.block_count", config.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", config.num_key_value_heads)
    writer.add_uint32(f"{arch}.attention.key_length", head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", head_dim)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    theta = config.rope_parameters.get("full_attention", config.rope_parameters)["rope_theta"]
    writer.add_float32(f"{arch}.rope.freq_base", theta)
    writer.add_uint32(f"{arch}.vocab_size", config.vocab_size)
    if family in ("gemma3", "gpt-oss"):
        writer.add_uint32(f"{arch}.attention.sliding_window", config.sliding_window)
    rope = config.rope_parameters
    if rope.get("rope_type") == "yarn":
        writer.add_string(f"{arch}.rope.scaling.type", "yarn")
        writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length",
                          rope["original_max_position_embeddings"])
        writer.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", rope["beta_fast"])
        writer.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", rope["beta_slow"])
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        writer.add_uint32(f"{arch}.expert_count", experts)
        writer.add_uint32(f"{arch}.expert_used_count", config.num_experts_per_tok)
        size = getattr(config, "moe_intermediate_size", config.intermediate_size)
        writer.add_uint32(f"{arch}.expert_feed_forward_length", size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_uint32(f"{arch}.expert_shared_feed_forward_length",
                          config.shared_expert_intermediate_size)
