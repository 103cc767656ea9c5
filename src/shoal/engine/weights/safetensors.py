"""Hugging Face directories: config.json -> ModelConfig, *.safetensors -> (name, RawTensor).

The family's declaration (models/families/) names the config.json keys and, through the gguf
package's TensorNameMap, the tensor names. Families whose norms compute (1 + w) from a
stored w (Gemma) declare the offset; this reader adds it, so every norm in shoal multiplies
by its weight directly (as GGUF files already store it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.config import ModelConfig
from shoal.engine.models.registry import family_of, hf_architecture_name
from shoal.engine.weights.names import LayerRange, TensorNames, in_stage
from shoal.engine.weights.quant import RawTensor


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
        family = family_of(config.architecture)
        names = TensorNames(family, config.num_layers)
        for file in self.files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    split = family.hf_tensor_split
                    parts = None if split is None else split(name, partial(handle.get_tensor, name))
                    if parts is None:  # read as it is, only if this stage needs it
                        parts = [(name, partial(handle.get_tensor, name))]
                    for part, load in parts:
                        canonical, layer = names.from_hf(part)
                        if canonical is None or not in_stage(canonical, layer, start, end, config):
                            continue
                        tensor = load()
                        if family.hf_norm_offset and canonical.endswith("norm.weight"):
                            tensor = tensor.float() + family.hf_norm_offset
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


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from a config.json dict (text config of multimodal wrappers too)."""
    hf = hf.get("text_config", hf) if "text_config" in hf and "hidden_size" not in hf else hf
    name = hf_architecture_name(hf)
    family = family_of(name)
    if family.task != "generate":
        raise UnsupportedModel(f"{name} is an embedding model; it cannot generate text")
    keys, defaults = family.hf_config_keys, family.config_defaults

    def read(field: str, default: Any = None) -> Any:
        return hf.get(keys[field], default)

    hidden, heads = hf[keys["hidden_size"]], hf[keys["num_heads"]]
    rope = _rope_parameters(hf)
    values = dict(
        defaults,
        architecture=family.name, num_layers=hf[keys["num_layers"]], hidden_size=hidden,
        intermediate_size=hf[keys["intermediate_size"]], num_heads=heads,
        num_kv_heads=read("num_kv_heads") or heads, head_dim=read("head_dim") or hidden // heads,
        vocab_size=hf[keys["vocab_size"]], max_position=read("max_position", 2048),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rms_eps=float(read("rms_eps", 1e-6)),
        tie_embeddings=bool(read("tie_embeddings", defaults.get("tie_embeddings", False))),
        qkv_bias=bool(read("qkv_bias", defaults.get("qkv_bias", False))),
        rope_scaling_factor=_linear_factor(rope, family.rope_scalings),
    )
    if not family.supports_sliding_window and hf.get("sliding_window") \
            and hf.get("use_sliding_window"):
        raise UnsupportedModel(f"sliding-window attention is not supported for {family.name} "
                               "(only for Gemma 3)")
    if family.hf_config_extras is not None:
        values.update(family.hf_config_extras(hf, values))
    return ModelConfig(**values)


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


def _linear_factor(rope: dict, supported: tuple[str, ...]) -> float:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default" or (kind != "linear" and kind in supported):
        return 1.0  # another scaling the family's extras read
    if kind == "linear":
        return float(rope["factor"])
    raise UnsupportedModel(f"RoPE scaling {kind!r} is not supported")
