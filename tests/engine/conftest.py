"""Fixtures for the forward-path tests: tiny random checkpoints of every family."""

from __future__ import annotations

import pytest
import tiny_models


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> TinyCheckpoint (safetensors dir + GGUF + transformers references)."""
    directory = tmp_path_factory.mktemp("tiny-models")
    return {family: tiny_models.build(family, directory) for family in tiny_models.FAMILIES}
