"""Checkpoint architecture names -> shoal's model families and their classes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shoal.engine.config import ModelTask
from shoal.engine.errors import UnsupportedModel

# GGUF general.architecture and HF config.json "architectures" entries.
_FAMILIES = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "gemma3": "gemma3", "gemma3_text": "gemma3",
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "bert": "bert", "BertModel": "bert", "BertForMaskedLM": "bert",
}
# Families that encode text into embeddings instead of generating it (models/bert.py).
EMBEDDING_FAMILIES = frozenset({"bert"})


def canonical_architecture(name: str) -> str:
    """The family ("llama", "qwen2", "qwen3", "gemma3", "bert") of an architecture name."""
    try:
        return _FAMILIES[name]
    except KeyError:
        supported = ", ".join(sorted(_FAMILIES))
        raise UnsupportedModel(
            f"architecture {name!r} is not supported (supported: {supported})") from None


def is_embedding_family(family: str) -> bool:
    return family in EMBEDDING_FAMILIES


def task_of_hf_config(hf: dict[str, Any]) -> ModelTask:
    """"embed" for an encoder checkpoint's config.json, "generate" for anything else (an
    unsupported architecture is reported when the engine loads it)."""
    names = hf.get("architectures") or [hf.get("model_type", "")]
    family = _FAMILIES.get(names[0]) if names and isinstance(names[0], str) else None
    return "embed" if family in EMBEDDING_FAMILIES else "generate"


def model_class(family: str):
    """The nn.Module class that runs a family (imported lazily: torch-heavy modules)."""
    if family in ("llama", "qwen2", "qwen3"):
        from shoal.engine.models.llama import LlamaModel
        return LlamaModel
    if family == "gemma3":
        from shoal.engine.models.gemma3 import Gemma3Model
        return Gemma3Model
    if family in EMBEDDING_FAMILIES:
        raise UnsupportedModel(f"{family!r} is an embedding model; it cannot generate text")
    raise UnsupportedModel(f"model family {family!r} is not supported")


def encoder_loader(family: str) -> Callable[..., Any]:
    """load(directory, dtype, device, progress) -> encoder module, for an embedding family."""
    if family == "bert":
        from shoal.engine.models.bert import load_bert
        return load_bert
    raise UnsupportedModel(f"model family {family!r} does not produce embeddings")
