"""ModelFacts: the few numbers placement needs about a model, read cheaply from its files.

Only headers are read (GGUF metadata, config.json) and file sizes summed; no weights load and
no torch import, so the node process can compute facts before any runner exists.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from pydantic import BaseModel, ConfigDict, model_validator

from shoal.catalog.projector import projector_beside
from shoal.diffusion.files import pipeline_weight_bytes
from shoal.engine.config import ModelSource
from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.families.family import GGUF_CONFIG_KEYS, HF_CONFIG_KEYS
from shoal.engine.models.registry import find_family, hf_architecture_name
from shoal.ids import ModelId


class ModelFacts(BaseModel):
    """Size and attention shape of one model, as placement sees it.

    weight_bytes is the size of the weight files (every expert's included); placement
    multiplies it by an engine overhead factor. measured_bytes: what a runner holding the
    whole model held once loaded (catalog/measured_sizes.py), which placement counts for a
    whole copy in place of its estimate; None before the model's first load. intermediate_size is None when the
    checkpoint does not say. n_experts: the experts of each mixture-of-experts layer (0 for
    a dense model); expert_bytes: the part of weight_bytes those routed experts take (what
    expert sharding splits; a shared expert is not among them).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelId
    weight_bytes: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int | None = None
    n_experts: int = 0
    expert_bytes: int = 0
    # Tokens in its vocabulary (0: unknown): its tokenizer's tables grow with it.
    vocab_size: int = 0
    # False for an embedding model: no KV cache, no sampler or grammar machinery.
    generates: bool = True
    measured_bytes: int | None = None
    # The checkpoint's architecture name (GGUF general.architecture, config.json's
    # architectures[0]): which backends can run it. None when facts were made by hand.
    architecture: str | None = None
    # Multi-head latent attention (DeepSeek): each token caches one row of this many
    # elements per layer (the latent and the rope key), read as keys and values alike, in
    # place of a key and a value per KV head; 0: no latent.
    kv_latent_dim: int = 0

    @model_validator(mode="after")
    def _check(self) -> ModelFacts:
        if self.weight_bytes < 0:
            raise ValueError("weight_bytes must be >= 0")
        for name in ("n_layers", "n_heads", "n_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                             f"({self.n_kv_heads})")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError("intermediate_size must be >= 1")
        if self.n_experts < 0:
            raise ValueError("n_experts must be >= 0")
        if not 0 <= self.expert_bytes <= self.weight_bytes:
            raise ValueError("expert_bytes must be between 0 and weight_bytes")
        if self.expert_bytes and not self.n_experts:
            raise ValueError("expert_bytes needs n_experts")
        if self.vocab_size < 0:
            raise ValueError("vocab_size must be >= 0")
        if self.kv_latent_dim < 0:
            raise ValueError("kv_latent_dim must be >= 0")
        if self.measured_bytes is not None and self.measured_bytes < 1:
            raise ValueError("measured_bytes must be >= 1")
        return self

    def kv_bytes_per_token_per_layer(self, element_bytes: int, kv_heads: int | None = None,
                                     scale_bytes: int = 0, scale_group: int = 16) -> int:
        """K and V of one token in one layer: 2 * kv_heads * (head_dim * element_bytes +
        the row's scales), a row holding scale_bytes per scale_group channels (one scale
        where head_dim is not a multiple of it), as engine/kv/quant.py lays out int8 rows.
        With latent attention: its one row of kv_latent_dim (every rank holds it whole)."""
        rows, dim = 2 * (self.n_kv_heads if kv_heads is None else kv_heads), self.head_dim
        if self.kv_latent_dim:
            rows, dim = 1, self.kv_latent_dim
        scales = dim // scale_group if dim % scale_group == 0 else 1
        return rows * (dim * element_bytes + scale_bytes * scales)


def model_facts_from_source(source: ModelSource) -> ModelFacts:
    """ModelFacts from a resolved model's header and file sizes (UnsupportedModel if unreadable)."""
    if source.format == "gguf":
        return _gguf_facts(ModelId(source.model_id), Path(source.path))
    if source.format == "diffusers":
        return _pipeline_facts(ModelId(source.model_id), Path(source.path))
    return _safetensors_facts(ModelId(source.model_id), Path(source.path))


def _pipeline_facts(model: ModelId, directory: Path) -> ModelFacts:
    """A diffusers pipeline: its weights, and a nominal one-layer, one-head shape, since it
    keeps no KV cache (the reservation placement adds for one is a few KiB) and is never
    split across nodes (images are served where they are asked for)."""
    try:
        weight_bytes = pipeline_weight_bytes(directory)
    except ValueError as error:
        raise UnsupportedModel(str(error)) from error
    return ModelFacts(model=model, weight_bytes=weight_bytes, n_layers=1, n_heads=1,
                      n_kv_heads=1, head_dim=1)


def _gguf_facts(model: ModelId, path: Path) -> ModelFacts:
    # The reader imports numpy and the gguf package, which a node serving no GGUF never needs.
    from shoal.engine.weights.gguf_file import GGUFFile

    reader = GGUFFile(path)
    metadata = reader.metadata
    arch = metadata.get("general.architecture")
    # A family shoal cannot run still has facts: its keys are the common ones.
    family = find_family(str(arch))
    keys = family.gguf_config_keys if family is not None else GGUF_CONFIG_KEYS

    def field(name: str, default=None):
        key = f"{arch}.{keys[name]}"
        value = metadata.get(key)
        if value is None and default is None:
            raise UnsupportedModel(f"{path}: GGUF metadata lacks {key}")
        return default if value is None else value

    heads = int(field("num_heads"))
    hidden = int(field("hidden_size"))
    intermediate = metadata.get(f"{arch}.{keys['intermediate_size']}")
    # A projector beside it (llama-server loads it to take images) is held with it.
    projector = projector_beside(path)
    return ModelFacts(
        model=model, weight_bytes=path.stat().st_size + (
            projector.stat().st_size if projector is not None else 0),
        # GLM-4.5's block_count counts its multi-token-prediction layers, which never run.
        n_layers=int(field("num_layers")) - int(metadata.get(f"{arch}.nextn_predict_layers") or 0),
        n_heads=heads,
        n_kv_heads=int(field("num_kv_heads", heads)),
        head_dim=int(field("head_dim", hidden // heads)),
        # Mixture-of-experts files store a per-layer array here; treat that as unknown.
        intermediate_size=intermediate if isinstance(intermediate, int) else None,
        n_experts=int(metadata.get(f"{arch}.expert_count") or 0),
        # A layer's routed experts are one 3-D tensor each: ffn_{gate,up,down}_exps.
        expert_bytes=sum(info.nbytes for name, info in reader.tensors.items()
                         if "_exps." in name),
        vocab_size=_gguf_vocab_size(reader),
        generates=family is None or family.task == "generate",
        architecture=str(arch) if arch is not None else None,
        kv_latent_dim=_latent_dim(keys, lambda key: metadata.get(f"{arch}.{key}")))


def _latent_dim(keys, read) -> int:
    """A latent-attention family's cached row (kv_lora_rank + kv_rope_dim, as its config
    keys name them; read(key) -> value or None), else 0."""
    if "kv_lora_rank" not in keys:
        return 0
    rank, rope = read(keys["kv_lora_rank"]), read(keys["kv_rope_dim"])
    if rank is None or rope is None:
        raise UnsupportedModel(f"latent attention needs {keys['kv_lora_rank']} and "
                               f"{keys['kv_rope_dim']}")
    return int(rank) + int(rope)


def _gguf_vocab_size(reader) -> int:
    """The vocabulary's size from the token embedding's shape ([hidden, vocab] in GGUF
    order; decoding the token list itself would read every token string)."""
    embedding = reader.tensors.get("token_embd.weight")
    return int(embedding.dims[-1]) if embedding is not None and embedding.dims else 0


def _safetensors_facts(model: ModelId, directory: Path) -> ModelFacts:
    config_path = directory / "config.json"
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise UnsupportedModel(f"{config_path}: cannot read config.json ({error})") from error
    # Multimodal wrappers nest the decoder's settings in text_config.
    if "text_config" in hf and "num_hidden_layers" not in hf:
        hf = hf["text_config"]
    family = find_family(hf_architecture_name(hf))
    keys = family.hf_config_keys if family is not None else HF_CONFIG_KEYS
    try:
        heads = int(hf[keys["num_heads"]])
        # Qwen's MoE configs say num_experts, Mixtral's num_local_experts, GLM's and
        # DeepSeek's n_routed_experts.
        experts = int(hf.get("num_experts") or hf.get("num_local_experts")
                      or hf.get("n_routed_experts") or 0)
        return ModelFacts(
            model=model,
            weight_bytes=sum(f.stat().st_size for f in directory.glob("*.safetensors")),
            n_layers=int(hf[keys["num_layers"]]), n_heads=heads,
            n_kv_heads=int(hf.get(keys["num_kv_heads"]) or heads),
            head_dim=int(hf.get(keys["head_dim"]) or int(hf[keys["hidden_size"]]) // heads),
            intermediate_size=hf.get(keys["intermediate_size"]),
            n_experts=experts,
            expert_bytes=_safetensors_expert_bytes(directory) if experts else 0,
            vocab_size=int(hf.get("vocab_size") or 0),
            generates=family is None or family.task == "generate",
            architecture=hf_architecture_name(hf),
            kv_latent_dim=_latent_dim(keys, hf.get))
    except (KeyError, TypeError) as error:
        raise UnsupportedModel(f"{config_path}: missing or bad field {error}") from error


# "model.layers.3.mlp.experts.5.up_proj.weight": a routed expert's tensor; gpt-oss keeps a
# layer's experts fused ("model.layers.3.mlp.experts.gate_up_proj", its _blocks, _bias).
_HF_EXPERT = re.compile(r"\.experts\.(\d+\.|gate_up_proj|down_proj)")
# safetensors' own limit on a header's size.
_MAX_HEADER_BYTES = 100_000_000


def _safetensors_expert_bytes(directory: Path) -> int:
    """Bytes of the routed experts' tensors, from the files' headers (8-byte length, then
    JSON: name -> dtype, shape, data_offsets)."""
    total = 0
    for file in directory.glob("*.safetensors"):
        try:
            with open(file, "rb") as handle:
                size = struct.unpack("<Q", handle.read(8))[0]
                if size > _MAX_HEADER_BYTES:
                    raise ValueError(f"a header of {size} bytes")
                header = json.loads(handle.read(size))
        except (OSError, ValueError, struct.error) as error:
            raise UnsupportedModel(f"{file}: unreadable safetensors header ({error})") from error
        total += sum(entry["data_offsets"][1] - entry["data_offsets"][0]
                     for name, entry in header.items()
                     if name != "__metadata__" and _HF_EXPERT.search(name))
    return total
