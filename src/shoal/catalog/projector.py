"""A GGUF model's multimodal projector: the vision half of a model that takes images, kept
as its own GGUF file beside the text model's, as Hugging Face GGUF repositories and
llama.cpp's model directories lay it out (`mmproj-F16.gguf` beside `model-Q4_K_M.gguf`).
llama-server loads it with --mmproj; placement counts its bytes with the model's."""

from __future__ import annotations

from pathlib import Path


def projector_beside(model_path: Path) -> Path | None:
    """The `mmproj*.gguf` in a GGUF model's directory (of several, such as mmproj-F16 and
    mmproj-F32, the first by name), or None."""
    if model_path.suffix.lower() != ".gguf":
        return None
    try:
        found = sorted(path for path in model_path.parent.iterdir()
                       if path.name.lower().startswith("mmproj")
                       and path.suffix.lower() == ".gguf" and path != model_path)
    except OSError:
        return None
    return found[0] if found else None
