"""Hugging Face directories: config.json -> ModelConfig, *.safetensors -> (name, RawTensor).

Gemma 3 stores RMSNorm weights as w with the model computing (1 + w); this reader adds the 1
so every norm in shoal multiplies by its weight directly (as GGUF files already store it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.config import ModelConfig
from shoal.engine.models.registry import canonical_architecture, is_embedding_family
from shoal.engine.weights.names import LayerRange, in_stage
from shoal.engine.weights.quant import RawTensor

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_COMMON_PARTS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "q", "self_attn.k_proj": "k",
    "self_attn.v_proj": "v", "self_attn.o_proj": "o", "self_attn.q_norm": "q_norm",
    "self_attn.k_norm": "k_norm", "mlp.gate_proj": "gate", "mlp.up_proj": "up",
    "mlp.down_proj": "down",
}
# post_attention_layernorm is the pre-MLP norm in llama-style blocks but a true
# post-attention norm in Gemma 3, which has its own pre_feedforward_layernorm.
_LLAMA_PARTS = {**_COMMON_PARTS, "post_attention_layernorm": "mlp_norm"}
_GEMMA_PARTS = {**_COMMON_PARTS, "post_attention_layernorm": "post_attn_norm",
                "pre_feedforward_layernorm": "mlp_norm",
                "post_feedforward_layernorm": "post_mlp_norm"}
_GLOBAL = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "lm_head.weight"}


class SafetensorsCheckpoint:
    """A directory with config.json and one or more *.safetensors files."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise UnsupportedModel(f"{self.path} has no config.json")
        self.hf_config = json.loads(config_path.read_text())
        self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise UnsupportedModel(f"{self.path} has no .safetensors files")
        self.config = config_from_hf(self.hf_config)

    def stream(self, layer_range: LayerRange | None = None) -> Iterator[tuple[str, RawTensor]]:
        from safetensors import safe_open

        config = self.config
        start, end = layer_range or (0, config.num_layers)
        parts = _GEMMA_PARTS if config.architecture == "gemma3" else _LLAMA_PARTS
        for file in self.files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    canonical, layer = _canonical(name, parts)
                    if canonical is None or not in_stage(canonical, layer, start, end, config):
                        continue
                    tensor = handle.get_tensor(name)
                    if config.architecture == "gemma3" and canonical.endswith("norm.weight"):
                        tensor = tensor.float() + 1.0
                    yield canonical, RawTensor(tuple(tensor.shape), "dense", tensor)


def read_tensors(directory: Path) -> Iterator[tuple[str, RawTensor]]:
    """Every tensor in a directory's *.safetensors files under its stored name (encoders,
    whose names need no mapping to the decoder layout)."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise UnsupportedModel(f"{directory} has no .safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                yield name, RawTensor(tuple(tensor.shape), "dense", tensor)


def _canonical(name: str, parts: dict[str, str]) -> tuple[str | None, int | None]:
    if name in _GLOBAL:
        return _GLOBAL[name], None
    match = _LAYER.match(name)
    if match is None or match.group(2) not in parts:
        return None, None
    layer = int(match.group(1))
    return f"layers.{layer}.{parts[match.group(2)]}.{match.group(3)}", layer


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from a config.json dict (text config of multimodal wrappers too)."""
    hf = hf.get("text_config", hf) if "text_config" in hf and "hidden_size" not in hf else hf
    names = hf.get("architectures") or [hf.get("model_type", "")]
    family = canonical_architecture(names[0])
    if is_embedding_family(family):
        raise UnsupportedModel(f"{names[0]} is an embedding model; it cannot generate text")
    heads = hf["num_attention_heads"]
    rope = _rope_parameters(hf)
    common = dict(
        architecture=family, num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        vocab_size=hf["vocab_size"], max_position=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", family == "gemma3")),
        qkv_bias=bool(hf.get("attention_bias", family == "qwen2")),
        qk_norm=family in ("qwen3", "gemma3"),
        rope_scaling_factor=_linear_factor(rope),
    )
    if family == "gemma3":
        return _gemma3(hf, common)
    if hf.get("sliding_window") and hf.get("use_sliding_window"):
        raise UnsupportedModel("sliding-window attention is only supported for Gemma 3")
    return ModelConfig(**common)


def _rope_parameters(hf: dict) -> dict:
    # transformers 5 nests RoPE settings in rope_parameters (per layer type for Gemma 3).
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        params = params["full_attention"]
    merged = {"rope_theta": hf.get("rope_theta", 10000.0)}
    if hf.get("rope_scaling"):
        merged.update(hf["rope_scaling"])
    merged.update(params)
    return merged


def _linear_factor(rope: dict) -> float:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return 1.0
    if kind == "linear":
        return float(rope["factor"])
    raise UnsupportedModel(f"RoPE scaling {kind!r} is not supported")


def _gemma3(hf: dict, common: dict) -> ModelConfig:
    layers = common["num_layers"]
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % hf.get("sliding_window_pattern", 6) == 0
        else "sliding_attention" for i in range(layers)]
    local = (hf.get("rope_parameters") or {}).get("sliding_attention", {})
    local_theta = local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    return ModelConfig(
        **common,
        sliding_window=hf.get("sliding_window", 512),
        layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in types),
        rope_local_theta=float(local_theta),
        attention_scale=float(hf.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5,
        hidden_activation="gelu_tanh",
        final_logit_softcap=hf.get("final_logit_softcapping"),
    )
