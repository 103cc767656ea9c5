"""One declaration per model family; engine/models/registry.py looks them up by name."""
