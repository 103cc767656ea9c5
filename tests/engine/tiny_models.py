"""Tiny random-weight checkpoints of each family, saved as an HF safetensors directory and
as a GGUF file, with the transformers model that serves as the fp32 reference."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# deepseek3 and deepseek2 are both shoal's (and llama.cpp's) deepseek2 family: DeepSeek-V3's
# shape (q rank, sigmoid grouped routing, the newer GGUF form with k_b / v_b) and
# DeepSeek-V2-Lite's (no q rank, softmax routing over groups, YaRN, the older kv_b form).
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "mixtral", "glm4moe",
            "deepseek3", "deepseek2", "gemma3")
MOE_FAMILIES = ("qwen3moe", "qwen2moe", "mixtral", "glm4moe", "deepseek3", "deepseek2")
_ARCHITECTURE = {"deepseek3": "deepseek2"}  # shoal's family name where the key is not it
DENSE_FAMILIES = tuple(f for f in FAMILIES if f not in MOE_FAMILIES)
VOCAB = 128
# llama.cpp writes Mixtral as "llama" (with experts), its q/k rows permuted as llama's.
_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3moe",
              "qwen2moe": "qwen2moe", "mixtral": "llama", "glm4moe": "glm4moe",
              "deepseek3": "deepseek2", "deepseek2": "deepseek2", "gemma3": "gemma3",
              "gpt-oss": "gpt-oss"}
_DEEPSEEK = ("deepseek3", "deepseek2")
# The latent attention's shape: heads of 16 + 8 (rope) dimensions, values of 16.
LATENT = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
_PERMUTED_QK = ("llama", "mixtral")
# The mixture-of-experts shape: 8 experts of 32, 2 chosen per token.
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
# GLM-4.5's and DeepSeek-V3's routing on that shape: 4 groups of 2 experts, the best 2 groups
# compete, a dense first layer, one shared expert; the weights sum to 1.5.
GROUPED_EXPERTS = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                       norm_topk_prob=True, routed_scaling_factor=1.5)
# Families whose checkpoints hold multi-token-prediction layers after the decoder's (the
# tiny files get one, which the loaders must ignore).
_NEXTN_FAMILIES = ("glm4moe",)


def architecture(family: str) -> str:
    """The family name shoal's loaders report for a tiny checkpoint's key."""
    return _ARCHITECTURE.get(family, family)


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
        shape = dict(num_hidden_layers=2, head_dim=32)  # overrides may replace these too
        return tf.Qwen3MoeConfig(rope_theta=10000.0, norm_topk_prob=True,
                                 **(shape | EXPERTS | common))
    if family == "qwen2moe":  # top-k weights not renormalised, as Qwen1.5-MoE's
        return tf.Qwen2MoeConfig(num_hidden_layers=2, rope_theta=10000.0,
                                 shared_expert_intermediate_size=64, **(EXPERTS | common))
    if family == "mixtral":  # every expert is intermediate_size wide
        common.update(intermediate_size=EXPERTS["moe_intermediate_size"])
        return tf.MixtralConfig(num_hidden_layers=2, rope_theta=10000.0, sliding_window=None,
                                num_local_experts=EXPERTS["num_experts"],
                                num_experts_per_tok=EXPERTS["num_experts_per_tok"], **common)
    if family == "glm4moe":  # q/k norm and biases, RoPE on half of each head, 3 layers
        common.update(tie_word_embeddings=False)
        return tf.Glm4MoeConfig(num_hidden_layers=3, head_dim=32, rope_theta=10000.0,
                                partial_rotary_factor=0.5, use_qk_norm=True,
                                attention_bias=True, num_nextn_predict_layers=1,
                                **(GROUPED_EXPERTS | common))
    if family == "deepseek3":  # a q rank, sigmoid routing with the score bias
        common.update(tie_word_embeddings=False, num_key_value_heads=4)
        return tf.DeepseekV3Config(num_hidden_layers=3, q_lora_rank=32, rope_theta=10000.0,
                                   **(GROUPED_EXPERTS | LATENT | common))
    if family == "deepseek2":  # V2-Lite's: no q rank, softmax over groups, YaRN
        common.update(tie_word_embeddings=False, num_key_value_heads=4)
        yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                    original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                    mscale=0.707, mscale_all_dim=0.707)
        # One group kept: a group's best score ranks it, so with as many groups kept as
        # experts chosen the groups could never change a choice.
        experts = GROUPED_EXPERTS | dict(n_shared_experts=2, norm_topk_prob=False,
                                         routed_scaling_factor=2.0, topk_group=1)
        return tf.DeepseekV2Config(num_hidden_layers=3, q_lora_rank=None,
                                   topk_method="group_limited_greedy", rope_parameters=yarn,
                                   **(experts | LATENT | common))
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
               "glm4moe": tf.Glm4MoeForCausalLM, "deepseek3": tf.DeepseekV3ForCausalLM,
               "deepseek2": tf.DeepseekV2ForCausalLM, "gemma3": tf.Gemma3ForCausalLM,
               "gpt-oss": tf.GptOssForCausalLM}
    model = classes[family](config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Random norms and biases too, so a misplaced norm or bias shows in the logits.
            std = 0.3 if "norm" in name or "bias" in name else 0.08
            if family == "gpt-oss" and name.endswith(("sinks", "experts.gate_up_proj")):
                # Sinks that matter; gate/up large enough that the clamps of gpt-oss's
                # SwiGLU (at +-7) take part.
                std = 2.0 if name.endswith("sinks") else 0.6
            param.normal_(1.0 if ("norm" in name and family != "gemma3") else 0.0, std)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # steers the choice of experts
                buffer.normal_(0.0, 0.1)
    return model


def build(family: str, directory: Path, metadata: dict | None = None,
          expert_types: list[ExpertTypes] | None = None, **overrides) -> TinyCheckpoint:
    """metadata: more GGUF keys (a tokenizer's, say) written into the file; expert_types:
    the packed types of each layer's expert tensors (cycled over the layers)."""
    model = hf_model(family, **overrides)
    st_dir = directory / f"{family}-hf"
    model.save_pretrained(st_dir, safe_serialization=True)
    if family in _NEXTN_FAMILIES:
        _save_nextn_layer(model, st_dir)
    gguf_path = directory / f"{family}.gguf"
    dequantized = write_gguf(model, family, gguf_path, metadata, expert_types)
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
    "mlp.experts.down_proj": ("ffn_down_exps.weight", "Q8_0"),  # the type: ExpertTypes
    "mlp.shared_expert.gate_proj.weight": ("ffn_gate_shexp.weight", "Q4_1"),
    "mlp.shared_expert.up_proj.weight": ("ffn_up_shexp.weight", "Q8_0"),
    "mlp.shared_expert.down_proj.weight": ("ffn_down_shexp.weight", "Q4_0"),
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp.weight", "F32"),
    # GLM-4.5's and DeepSeek's shared experts (no gate) and sigmoid routers' score bias.
    "mlp.shared_experts.gate_proj.weight": ("ffn_gate_shexp.weight", "Q4_1"),
    "mlp.shared_experts.up_proj.weight": ("ffn_up_shexp.weight", "Q8_0"),
    "mlp.shared_experts.down_proj.weight": ("ffn_down_shexp.weight", "Q4_0"),
    "mlp.gate.e_score_correction_bias": ("exp_probs_b.bias", "F32"),
    # DeepSeek's latent attention (kv_b_proj is written by _write_kv_b).
    "self_attn.q_a_proj.weight": ("attn_q_a.weight", "Q8_0"),
    "self_attn.q_a_layernorm.weight": ("attn_q_a_norm.weight", "F32"),
    "self_attn.q_b_proj.weight": ("attn_q_b.weight", "Q4_1"),
    "self_attn.kv_a_proj_with_mqa.weight": ("attn_kv_a_mqa.weight", "Q8_0"),
    "self_attn.kv_a_layernorm.weight": ("attn_kv_a_norm.weight", "F32"),
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
        part = ("post_attention_norm.weight" if family in ("gemma3", "glm4moe", "gpt-oss")
                else "ffn_norm.weight")
        return f"blk.{index}.{part}", "F32"
    part, quant = _LAYER_MAP[suffix]
    return f"blk.{index}.{part}", quant


@dataclass(frozen=True)
class ExpertTypes:
    """The packed types of one layer's expert tensors. Types the gguf package cannot
    quantize (the K-quants) are written as valid random blocks, the model's values unused."""

    gate: str = "Q4_1"
    up: str = "Q4_0"
    down: str = "Q8_0"


def write_gguf(model, family: str, path: Path, metadata: dict | None = None,
               expert_types: list[ExpertTypes] | None = None) -> dict[str, torch.Tensor]:
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
        types = (expert_types or [ExpertTypes()])[_layer(hf_name) % len(expert_types or [0])]
        if family == "gpt-oss" and ".mlp.experts." in hf_name:
            stored[hf_name] = _write_gpt_oss_experts(writer, hf_name, tensor)
            continue
        if hf_name.endswith("mlp.experts.gate_up_proj"):
            stored[hf_name] = _write_gate_up_experts(writer, hf_name, tensor, types)
            continue
        if hf_name.endswith("self_attn.kv_b_proj.weight"):
            stored[hf_name] = _write_kv_b(writer, hf_name, tensor, config, split=family == "deepseek3")
            continue
        name, quant = _gguf_name(hf_name, family)
        if hf_name.endswith("mlp.experts.down_proj"):
            quant = types.down
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
    if family in _NEXTN_FAMILIES:  # a prediction layer's tensors after the last block
        layer = config.num_hidden_layers
        for name, values in _nextn_tensors(config).items():
            writer.add_tensor(f"blk.{layer}.{name}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _layer(hf_name: str) -> int:
    parts = hf_name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else 0


def _write_gate_up_experts(writer, hf_name: str, tensor: torch.Tensor,
                           types: ExpertTypes) -> torch.Tensor:
    """Writes [experts, 2 * size, hidden] as GGUF's gate and up expert tensors; returns the
    values they hold, concatenated back."""
    import gguf

    index = hf_name.split(".")[2]
    halves = tensor.float().numpy().copy().reshape(tensor.shape[0], 2, -1, tensor.shape[2])
    back = []
    # Gate and up in different packed types, as llama.cpp's mixes give them.
    parts = (("ffn_gate_exps.weight", types.gate), ("ffn_up_exps.weight", types.up))
    for half, (part, quant) in enumerate(parts):
        data, values = _encode(np.ascontiguousarray(halves[:, half]), quant)
        writer.add_tensor(f"blk.{index}.{part}", data,
                          raw_dtype=getattr(gguf.GGMLQuantizationType, quant))
        back.append(values.astype(np.float32))
    return torch.from_numpy(np.concatenate(back, axis=1)).reshape(tensor.shape)


def _write_kv_b(writer, hf_name: str, tensor: torch.Tensor, config, split: bool) -> torch.Tensor:
    """DeepSeek's kv_b [H * (nope + v), rank] as the current converter writes it (split:
    attn_k_b [H, rank, nope], transposed, and attn_v_b [H, v, rank]) or as older ones did
    (attn_kv_b whole); returns the values the file holds, in kv_b's shape."""
    import gguf

    index = hf_name.split(".")[2]
    heads, nope, v_dim = (config.num_attention_heads, config.qk_nope_head_dim,
                          config.v_head_dim)
    values = tensor.float().numpy().copy()
    if not split:
        data, back = _encode(values, "Q8_0")
        writer.add_tensor(f"blk.{index}.attn_kv_b.weight", data,
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        return torch.from_numpy(back.astype(np.float32)).reshape(tensor.shape)
    per_head = values.reshape(heads, nope + v_dim, -1)
    k_b = np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))  # [H, rank, nope]
    v_b = np.ascontiguousarray(per_head[:, nope:])                     # [H, v, rank]
    k_data, k_back = _encode(k_b, "F16")  # rows of nope = 16 values: no 32-blocks
    v_data, v_back = _encode(v_b, "Q8_0")
    writer.add_tensor(f"blk.{index}.attn_k_b.weight", k_data)
    writer.add_tensor(f"blk.{index}.attn_v_b.weight", v_data,
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    back = np.concatenate((k_back.reshape(k_b.shape).transpose(0, 2, 1),
                           v_back.reshape(v_b.shape)), axis=1)
    return torch.from_numpy(back.astype(np.float32)).reshape(tensor.shape)


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
    try:
        data = gguf.quants.quantize(values.astype(np.float32), qtype)
    except NotImplementedError:  # the K-quants: gguf only reads them
        data = _random_blocks(values, quant)
    return data, gguf.quants.dequantize(data, qtype).reshape(values.shape)


# Byte offsets of the fp16 scales in one block of each K-quant (ggml's block layouts).
_FP16_FIELDS = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def _random_blocks(values: np.ndarray, quant: str) -> np.ndarray:
    """Valid random blocks of a packed type in values' shape (seeded by its bytes): random
    quants and sub-scales, finite fp16 scales (std 1e-3: weights of about the tiny models'
    size)."""
    import gguf

    shape = values.shape
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[quant]]
    rng = np.random.default_rng(zlib.crc32(values.tobytes()))
    blocks = int(np.prod(shape)) // block_weights
    raw = rng.integers(0, 256, size=(blocks, block_bytes), dtype=np.uint8)
    for offset in _FP16_FIELDS[quant]:
        scale = (rng.standard_normal(blocks) * 1e-3).astype(np.float16)
        raw[:, offset:offset + 2] = scale.view(np.uint8).reshape(blocks, 2)
    return raw.reshape(*shape[:-1], shape[-1] // block_weights * block_bytes)


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf: interleave each head's two rotary halves.
    rows = weights.shape[0]
    return (weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    rows = weights.shape[0]
    return (weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _nextn_tensors(config) -> dict[str, np.ndarray]:
    """GGUF names (after "blk.{n}.") and values of a multi-token-prediction layer's tensors:
    huge where they would be read, so a loader that used them would go far wrong."""
    hidden = config.hidden_size
    return {"nextn.eh_proj.weight": np.full((hidden, 2 * hidden), 50.0, dtype=np.float32),
            "attn_norm.weight": np.full(hidden, 50.0, dtype=np.float32),
            "attn_q.weight": np.full((config.num_attention_heads * config.head_dim, hidden),
                                     50.0, dtype=np.float32)}


def _save_nextn_layer(model, directory: Path) -> None:
    from safetensors.torch import save_file

    config, layer = model.config, model.config.num_hidden_layers
    hf_names = {"nextn.eh_proj.weight": "eh_proj.weight",
                "attn_norm.weight": "input_layernorm.weight",
                "attn_q.weight": "self_attn.q_proj.weight"}
    save_file({f"model.layers.{layer}.{hf_names[name]}": torch.from_numpy(values)
               for name, values in _nextn_tensors(config).items()},
              str(directory / "model-nextn.safetensors"))


def _write_metadata(writer, config, family: str) -> None:
    arch = _GGUF_ARCH[family]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    nextn = 1 if family in _NEXTN_FAMILIES else 0
    writer.add_uint32(f"{arch}.block_count", config.num_hidden_layers + nextn)
    if nextn:
        writer.add_uint32(f"{arch}.nextn_predict_layers", nextn)
    writer.add_uint32(f"{arch}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", config.num_attention_heads)
    if family in _DEEPSEEK:
        _write_latent_attention(writer, arch, config)
    else:
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
    if family == "glm4moe":  # what llama.cpp's converter writes for GLM-4.5
        writer.add_uint32(f"{arch}.rope.dimension_count",
                          int(head_dim * config.rope_parameters["partial_rotary_factor"]))
    if getattr(config, "n_group", None):
        _write_grouped_experts(writer, arch, config)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_uint32(f"{arch}.expert_shared_feed_forward_length",
                          config.shared_expert_intermediate_size)


def _write_grouped_experts(writer, arch: str, config) -> None:
    import gguf

    writer.add_uint32(f"{arch}.expert_shared_count", config.n_shared_experts)
    writer.add_uint32(f"{arch}.leading_dense_block_count", config.first_k_dense_replace)
    writer.add_uint32(f"{arch}.expert_group_count", config.n_group)
    writer.add_uint32(f"{arch}.expert_group_used_count", config.topk_group)
    writer.add_float32(f"{arch}.expert_weights_scale", config.routed_scaling_factor)
    writer.add_bool(f"{arch}.expert_weights_norm", config.norm_topk_prob)
    # Real DeepSeek config.json files say scoring_func (V2 softmax, V3 sigmoid); GLM's
    # converter always writes sigmoid.
    softmax = getattr(config, "topk_method", None) is not None
    writer.add_uint32(f"{arch}.expert_gating_func", gguf.ExpertGatingFuncType.SOFTMAX
                      if softmax else gguf.ExpertGatingFuncType.SIGMOID)


def _write_latent_attention(writer, arch: str, config) -> None:
    """What llama.cpp's converter writes for DeepSeek's attention: one KV head of the
    latent's width, the heads' sizes under *_mla, and YaRN's settings."""
    rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
    writer.add_uint32(f"{arch}.attention.head_count_kv", 1)
    writer.add_uint32(f"{arch}.attention.key_length", rank + rope)
    writer.add_uint32(f"{arch}.attention.value_length", rank)
    writer.add_uint32(f"{arch}.attention.key_length_mla", config.qk_nope_head_dim + rope)
    writer.add_uint32(f"{arch}.attention.value_length_mla", config.v_head_dim)
    writer.add_uint32(f"{arch}.attention.kv_lora_rank", rank)
    if config.q_lora_rank:
        writer.add_uint32(f"{arch}.attention.q_lora_rank", config.q_lora_rank)
    writer.add_uint32(f"{arch}.rope.dimension_count", rope)
    params = config.rope_parameters
    if params.get("rope_type") == "yarn":
        writer.add_string(f"{arch}.rope.scaling.type", "yarn")
        writer.add_float32(f"{arch}.rope.scaling.factor", params["factor"])
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length",
                          params["original_max_position_embeddings"])
        writer.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", params["beta_fast"])
        writer.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", params["beta_slow"])
        writer.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier",
                           0.1 * params["mscale_all_dim"])
