"""A diffusers pipeline directory as placement sees it, read without torch or diffusers:
model_index.json names the components, each a folder of configs and weights."""

from __future__ import annotations

import json
from pathlib import Path

# diffusers loads one weights format per component: safetensors where there are any.
_WEIGHT_SUFFIXES = (".safetensors", ".bin")


def pipeline_components(directory: Path) -> list[str]:
    """The component folders model_index.json names (unet, vae, text_encoder, ...);
    ValueError when it is unreadable."""
    index_path = directory / "model_index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{index_path}: cannot read model_index.json ({error})") from error
    if not isinstance(index, dict):
        raise ValueError(f"{index_path}: model_index.json is not an object")
    # Components are [library, class] pairs; keys starting with "_" are the index's own.
    return sorted(name for name, value in index.items()
                  if not name.startswith("_") and isinstance(value, list)
                  and (directory / name).is_dir())


def pipeline_weight_bytes(directory: Path) -> int:
    """The bytes of the weight files the pipeline loads: per component, its safetensors
    files (variants such as *.fp16.safetensors only where there is no plain file), else its
    .bin files."""
    total = 0
    for component in pipeline_components(directory):
        folder = directory / component
        for suffix in _WEIGHT_SUFFIXES:
            files = [f for f in folder.glob(f"*{suffix}") if f.is_file()]
            plain = [f for f in files if f.name.count(".") == 1]  # not name.fp16.ext
            if files:
                total += sum(f.stat().st_size for f in (plain or files))
                break
    return total


def weights_variant(directory: Path) -> str | None:
    """The variant to load ("fp16" from name.fp16.safetensors) when some component holds
    only variant weights (a pull takes variants only where there is no plain file); None
    when every component has plain weights."""
    for component in pipeline_components(directory):
        files = [f.name for f in (directory / component).glob("*.safetensors")]
        if files and not any(name.count(".") == 1 for name in files):
            return files[0].split(".")[-2]
    return None
