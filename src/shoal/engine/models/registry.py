"""The model families shoal runs (models/families/), looked up by architecture name."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from shoal.engine.config import ModelTask
from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.families.bert import BERT
from shoal.engine.models.families.family import ModelFamily
from shoal.engine.models.families.deepseek2 import DEEPSEEK2
from shoal.engine.models.families.gemma3 import GEMMA3
from shoal.engine.models.families.glm4moe import GLM4MOE
from shoal.engine.models.families.gptoss import GPT_OSS
from shoal.engine.models.families.llama import LLAMA
from shoal.engine.models.families.mixtral import MIXTRAL
from shoal.engine.models.families.qwen2 import QWEN2
from shoal.engine.models.families.qwen2moe import QWEN2MOE
from shoal.engine.models.families.qwen3 import QWEN3
from shoal.engine.models.families.qwen3moe import QWEN3MOE

FAMILIES: tuple[ModelFamily, ...] = (LLAMA, MIXTRAL, QWEN2, QWEN2MOE, QWEN3, QWEN3MOE,
                                       GLM4MOE, DEEPSEEK2, GPT_OSS, GEMMA3, BERT)


def _by_name(families: tuple[ModelFamily, ...]) -> dict[str, ModelFamily]:
    index: dict[str, ModelFamily] = {}
    for family in families:
        for name in (family.name, *family.names):
            if index.setdefault(name, family) is not family:
                raise ValueError(f"architecture name {name!r} is declared by two families")
    return index


_BY_NAME = _by_name(FAMILIES)


def find_family(name: str) -> ModelFamily | None:
    """The family an architecture name (GGUF, config.json or shoal's own) means, if any."""
    return _BY_NAME.get(name)


def family_of(name: str) -> ModelFamily:
    """The family of an architecture name; UnsupportedModel if shoal has none."""
    family = find_family(name)
    if family is None:
        supported = ", ".join(sorted(_BY_NAME))
        raise UnsupportedModel(
            f"architecture {name!r} is not supported (supported: {supported})")
    return family


def hf_architecture_name(hf: Mapping[str, Any]) -> str:
    """The architecture a config.json names: its first "architectures" entry, else its
    model_type."""
    names = hf.get("architectures") or [hf.get("model_type", "")]
    return names[0] if names and isinstance(names[0], str) else ""


def task_of_hf_config(hf: Mapping[str, Any]) -> ModelTask:
    """"embed" for an encoder checkpoint's config.json, "generate" for anything else (an
    unsupported architecture is reported when the engine loads it)."""
    family = find_family(hf_architecture_name(hf))
    return family.task if family is not None else "generate"


def _model_attribute(family: ModelFamily) -> Any:
    # Imported when a model loads, not with the registry: model files import torch.
    module, attribute = family.model.split(":")
    return getattr(importlib.import_module(module), attribute)


def model_class(family: ModelFamily):
    """The nn.Module class that runs a generating family."""
    if family.task != "generate":
        raise UnsupportedModel(f"{family.name!r} is an embedding model; it cannot generate text")
    return _model_attribute(family)


def encoder_loader(family: ModelFamily) -> Callable[..., Any]:
    """load(directory, dtype, device, progress) -> encoder module, for an embedding family."""
    if family.task != "embed":
        raise UnsupportedModel(f"model family {family.name!r} does not produce embeddings")
    return _model_attribute(family)
