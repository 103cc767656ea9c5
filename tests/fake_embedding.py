"""A fake embedding engine (EngineCore as shoal.engine.embedding.EmbeddingEngine implements
it, no torch),
and an engine factory that serves it for task "embed" and the fake text engine otherwise.

Each word is one token (fakes.FakeTokenizer) between a [CLS]-like 2 and a [SEP]-like 3; a
vector is [tokens, first token, last token, 1.0] divided by its length, so tests can tell
inputs and their order apart. The context is MAX_MODEL_LEN tokens.
"""

from __future__ import annotations

import math
import json
from pathlib import Path

import numpy as np
from fakes import VOCAB_SIZE, FakeTokenizer, make_fake_engine

from shoal.engine.core import NoGeneration, NotFollower
from shoal.engine.errors import ContextLengthExceeded
from shoal.engine.sampling import InvalidParameter

MAX_MODEL_LEN = 16
DIMENSIONS = 4
CLS, SEP = 2, 3


def fake_vector(ids: list[int]) -> list[float]:
    raw = [float(len(ids)), float(ids[0]), float(ids[-1]), 1.0]
    norm = math.sqrt(sum(v * v for v in raw))
    return [v / norm for v in raw]


class FakeEmbeddingEngine(NoGeneration, NotFollower):
    task = "embed"
    tracer = None

    def __init__(self, config, progress=None) -> None:
        (progress or (lambda stage, fraction: None))("ready", 1.0)
        self.config = config
        self.model_id = config.source.model_id
        self.tokenizer = FakeTokenizer()
        self.tokenizer.has_chat_template = False
        self.vocab_size = VOCAB_SIZE
        self.max_model_len = MAX_MODEL_LEN
        self.dimensions = DIMENSIONS

    def weight_bytes(self) -> int:
        return 1234

    def kv_bytes_per_block(self):
        return None  # no KV cache

    def close(self) -> None:
        pass

    def tokenize(self, texts, truncate: bool) -> list[list[int]]:
        ids = [[CLS, *self.tokenizer.encode(text), SEP] for text in texts]
        if truncate:
            ids = [i if len(i) <= MAX_MODEL_LEN else [*i[:MAX_MODEL_LEN - 1], SEP] for i in ids]
        self._check(ids)
        return ids

    def check_token_ids(self, inputs, truncate: bool) -> list[list[int]]:
        ids = [list(i)[:MAX_MODEL_LEN] if truncate else list(i) for i in inputs]
        for index, row in enumerate(ids):
            if not row or any(not 0 <= t < VOCAB_SIZE for t in row):
                raise InvalidParameter("input", f"input {index} has a token outside the "
                                                f"vocabulary or no tokens")
        self._check(ids)
        return ids

    def _check(self, ids) -> None:
        for index, row in enumerate(ids):
            if len(row) > MAX_MODEL_LEN:
                raise ContextLengthExceeded(f"input {index} has {len(row)} tokens; this "
                                            f"model's maximum context length is "
                                            f"{MAX_MODEL_LEN} tokens")

    def embed(self, inputs) -> np.ndarray:
        return np.array([fake_vector(list(ids)) for ids in inputs], dtype=np.float32)


def make_engine(config, progress=None):
    if config.source.task == "embed":
        return FakeEmbeddingEngine(config, progress)
    return make_fake_engine(config, progress)


def fake_embedding_source(tmp_dir, model_id: str = "fake-embed"):
    """A ModelSource for the fake embedding engine (a directory: embedding models are
    safetensors directories)."""
    from shoal.engine.config import ModelSource

    directory = Path(tmp_dir) / model_id
    directory.mkdir(parents=True, exist_ok=True)
    # What placement reads of a model (shoal.cluster.model_facts); the engine reads nothing.
    (directory / "config.json").write_text(json.dumps(
        {"num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 32}))
    return ModelSource(model_id=model_id, format="safetensors", path=directory, task="embed")
