"""Every engine the runner drives implements EngineCore: shoal's three kinds (their
methods and kind; building one needs a model) and the tests' fakes (every member)."""

from __future__ import annotations

import pytest
from fake_embedding import FakeEmbeddingEngine, fake_embedding_source
from fakes import FakeEngine, FakeKVEngine, fake_engine_config

from shoal.engine.config import EngineConfig
from shoal.engine.core import EngineCore
from shoal.engine.embedding import EmbeddingEngine
from shoal.engine.engine import Engine
from shoal.engine.parallel.follower import FollowerEngine

METHODS = sorted(name for name, value in vars(EngineCore).items()
                 if callable(value) and not name.startswith("_"))


@pytest.mark.parametrize("kind, task, is_follower", [
    (Engine, "generate", False), (EmbeddingEngine, "embed", False),
    (FollowerEngine, "generate", True)])
def test_shoal_s_engines_have_every_method_and_say_their_kind(kind, task, is_follower):
    assert [name for name in METHODS if not callable(getattr(kind, name, None))] == []
    assert (kind.task, kind.is_follower) == (task, is_follower)


def test_the_fakes_implement_engine_core(tmp_path):
    fakes = [FakeEngine(fake_engine_config(tmp_path)), FakeKVEngine(fake_engine_config(tmp_path)),
             FakeEmbeddingEngine(EngineConfig(source=fake_embedding_source(tmp_path)))]
    for fake in fakes:
        assert isinstance(fake, EngineCore), type(fake).__name__
