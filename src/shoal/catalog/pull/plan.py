"""A pull, planned: the store name, the files to fetch and how to read them afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.catalog.pull.download import RemoteFile


@dataclass(frozen=True)
class PullPlan:
    key: str  # the store's name for the model
    source: str  # "huggingface" or "ollama"
    format: str  # "gguf", "safetensors" or "diffusers"
    weights: str  # relative path of the .gguf (its first part), or "." for a checkpoint
    files: tuple[RemoteFile, ...]
    headers: dict[str, str] = field(repr=False)  # sent with every file request (a token)
    label: str  # "pull 'x' from <source> (<endpoint>)", what errors start with
    origin: dict[str, Any] = field(default_factory=dict)  # repo and revision, or registry
    # Ollama's layers other than the model, by kind: file path in the model's directory.
    card_files: dict[str, str] = field(default_factory=dict)
    # A GGUF split into -0000N-of-0000M files: its parts in order, joined after the pull.
    split_parts: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return sum(file.size for file in self.files)
