"""The backends a model can be served by, by name.

`engine` is shoal's own (x86 CPUs); `llama-server` is llama.cpp's server binary, whatever
build the user has (CUDA, Metal, Vulkan, ROCm or CPU); `diffusers` serves image pipelines.
A node runs the ones it has; placement puts a model only where its backend runs.
"""

from __future__ import annotations

from typing import Literal, cast

BackendName = Literal["engine", "llama-server", "diffusers"]
BACKEND_NAMES: tuple[BackendName, ...] = ("engine", "llama-server", "diffusers")
DEFAULT_BACKEND: BackendName = "engine"


def parse_backend_name(text: str) -> BackendName:
    """A backend's name (ValueError naming the choices otherwise)."""
    name = text.strip().lower()
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {text!r}: choose one of {', '.join(BACKEND_NAMES)}")
    return cast(BackendName, name)


def parse_backend_assignment(text: str) -> tuple[str, BackendName]:
    """--backend MODEL=NAME as (model, backend)."""
    model, sep, name = text.rpartition("=")
    if not sep or not model.strip():
        raise ValueError(f"--backend takes MODEL=NAME, not {text!r}")
    return model.strip(), parse_backend_name(name)
