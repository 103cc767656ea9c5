"""Checkpoint architecture names -> shoal's model families and their classes."""

from __future__ import annotations

from shoal.engine.errors import UnsupportedModel

# GGUF general.architecture and HF config.json "architectures" entries.
_FAMILIES = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "gemma3": "gemma3", "gemma3_text": "gemma3",
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}


def canonical_architecture(name: str) -> str:
    """The family ("llama", "qwen2", "qwen3", "gemma3") of a checkpoint architecture name."""
    try:
        return _FAMILIES[name]
    except KeyError:
        supported = ", ".join(sorted(_FAMILIES))
        raise UnsupportedModel(
            f"architecture {name!r} is not supported (supported: {supported})") from None


def model_class(family: str):
    """The nn.Module class that runs a family (imported lazily: torch-heavy modules)."""
    if family in ("llama", "qwen2", "qwen3"):
        from shoal.engine.models.llama import LlamaModel
        return LlamaModel
    if family == "gemma3":
        from shoal.engine.models.gemma3 import Gemma3Model
        return Gemma3Model
    raise UnsupportedModel(f"model family {family!r} is not supported")
