"""ModelFamily: everything shoal knows about one model family, declared in one place.

Each module beside this one declares one family; engine/models/registry.py collects them.
The GGUF and safetensors readers, the tokenizer, the chat template, the catalog and the
cluster's model facts all read these declarations, so a new family is one new module here
(plus a model file when its structure differs from the llama skeleton).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from shoal.engine.config import ModelTask

# ModelConfig field (rope_scaling_type: the reader's check) -> GGUF metadata key, after the
# "<general.architecture>." prefix. Family-only keys are read by the family's extras; a
# latent-attention family adds kv_lora_rank and kv_rope_dim, which the cluster's model facts
# read for the size of its cached row (both maps).
GGUF_CONFIG_KEYS: Mapping[str, str] = MappingProxyType({
    "num_layers": "block_count",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_heads": "attention.head_count",
    "num_kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "vocab_size": "vocab_size",
    "max_position": "context_length",
    "rope_theta": "rope.freq_base",
    "rope_scaling_type": "rope.scaling.type",
    "rope_scaling_factor": "rope.scaling.factor",
    "rms_eps": "attention.layer_norm_rms_epsilon",
})

# ModelConfig field -> config.json key (RoPE settings are read by the safetensors reader,
# which knows both of transformers' layouts for them).
HF_CONFIG_KEYS: Mapping[str, str] = MappingProxyType({
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "max_position": "max_position_embeddings",
    "rms_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "qkv_bias": "attention_bias",
})

# (read, common) -> extra ModelConfig fields; read(key, default) reads the GGUF metadata key
# "<general.architecture>.<key>", common holds the fields already read.
GGUFConfigExtras = Callable[[Callable[[str, Any], Any], dict[str, Any]], dict[str, Any]]
# (config.json dict, common) -> extra ModelConfig fields.
HFConfigExtras = Callable[[Mapping[str, Any], dict[str, Any]], dict[str, Any]]
# (config.json checkpoint's tensor name, its loader) -> the (name, loader) pairs the gguf
# tables name in its place (a fused tensor split apart), or None to read it as it is.
HFTensorSplit = Callable[[str, Callable[[], Any]],
                         Iterable[tuple[str, Callable[[], Any]]] | None]


@dataclass(frozen=True, eq=False)  # one instance per family: compared by identity
class ModelFamily:
    """One family's names, config keys, tensor names and tokenizer and template quirks.

    name is the family's canonical name (ModelConfig.architecture, a catalog card's family).
    model is "module:attribute", imported only when a model of this family loads (torch):
    the decoder class for "generate" families, the loader function for "embed" ones.
    """

    name: str
    model: str
    task: ModelTask = "generate"
    # config.json "architectures" entries, and "model_type" values for files without them.
    hf_architectures: tuple[str, ...] = ()
    hf_model_types: tuple[str, ...] = ()
    gguf_architectures: tuple[str, ...] = ()   # GGUF general.architecture
    # The gguf package's MODEL_ARCH (by name) whose tensor tables (MODEL_TENSORS,
    # TensorNameMap) give this family's GGUF and Hugging Face tensor names; None: the
    # model file reads the checkpoint's own names.
    tensor_tables: str | None = None
    # MODEL_TENSOR name -> canonical part, where this family's use of a tensor kind differs
    # from weights/names.py's (GLM-4.5's post_attention_norm is its pre-MLP norm).
    tensor_parts: Mapping[str, str] = field(default_factory=dict)
    gguf_config_keys: Mapping[str, str] = field(default_factory=lambda: GGUF_CONFIG_KEYS)
    hf_config_keys: Mapping[str, str] = field(default_factory=lambda: HF_CONFIG_KEYS)
    # ModelConfig values of this family where the checkpoint does not say otherwise. GGUF
    # files say tie_embeddings, qkv_bias and qk_norm by which tensors they hold.
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    gguf_config_extras: GGUFConfigExtras | None = None
    hf_config_extras: HFConfigExtras | None = None
    # The RoPE scalings this family's readers accept ("yarn": the family's extras read it).
    rope_scalings: tuple[str, ...] = ("none", "linear")
    hf_tensor_split: HFTensorSplit | None = None
    # Whether a config.json may turn sliding-window attention on (the extras read it).
    supports_sliding_window: bool = False
    # llama.cpp's converter stores this family's q/k rows permuted (rotary halves
    # interleaved per head); the GGUF reader restores Hugging Face's order.
    gguf_permuted_qk: bool = False
    # Added to every norm weight read from config.json checkpoints (Gemma stores w and
    # computes 1 + w; GGUF files already hold 1 + w).
    hf_norm_offset: float = 0.0
    # "gemma": a SentencePiece vocabulary that spells runs of spaces as real spaces and
    # ranks merges by position, not score (tokenizer/gguf_vocab.py).
    sentencepiece_style: Literal["standard", "gemma"] = "standard"
    # The chat format of a checkpoint that carries no template; None: ChatML.
    default_chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.task not in ("generate", "embed"):
            raise ValueError(f"family {self.name}: task must be generate or embed")
        if ":" not in self.model:
            raise ValueError(f"family {self.name}: model must be 'module:attribute'")

    @property
    def names(self) -> tuple[str, ...]:
        """Every architecture name that means this family, from either file format."""
        return self.gguf_architectures + self.hf_architectures + self.hf_model_types
