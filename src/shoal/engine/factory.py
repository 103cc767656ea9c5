"""The engine a runner builds for a configuration: which kind of EngineCore serves it."""

from __future__ import annotations

from shoal.engine.config import EngineConfig
from shoal.engine.core import EngineCore, ProgressCallback
from shoal.engine.embedding import EmbeddingEngine
from shoal.engine.engine import Engine
from shoal.engine.parallel.follower import FollowerEngine


def build_engine(config: EngineConfig, progress: ProgressCallback) -> EngineCore:
    """FollowerEngine for a rank other than 0 of a split model, EmbeddingEngine for an
    embedding model, the generating Engine otherwise."""
    if config.parallel is not None and config.parallel.rank > 0:
        return FollowerEngine(config, progress)
    if config.source.task == "embed":
        return EmbeddingEngine(config, progress)
    return Engine(config, progress)
