"""Engine.export_prefix / import_prefix on the built-in model in float32 (slow)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shoal.catalog.resolve import DEFAULT_MODEL_ID, resolve_model
from shoal.engine.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.engine.kv.transfer import TransferError
from shoal.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

TEXT = " ".join(["The lighthouse keeper counted the ships that passed the rocks at night."] * 12)


def make_engine(cache_dir) -> Engine:
    return Engine(EngineConfig(source=resolve_model(DEFAULT_MODEL_ID), dtype="float32",
                               kv_cache_bytes=32 * 2**20, max_num_batched_tokens=128,
                               cache_dir=cache_dir))


def generate(engine: Engine, request_id: str, prompt: list[int]):
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                          ignore_eos=True))
    tokens, last = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.extend(output.token_ids)
            last = output
    return tokens, last.cached_tokens


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("cache")
    return make_engine(cache_dir), make_engine(cache_dir)


def test_a_prefix_exported_from_one_engine_serves_another_identically(engines):
    source, target = engines
    prompt = source.tokenizer.encode(TEXT)
    assert len(prompt) > 6 * 16
    computed, cached = generate(source, "cold", prompt)
    assert cached == 0

    blocks = source.export_prefix(prompt)
    assert blocks.num_blocks == len(prompt) // 16
    assert target.import_prefix(blocks) == blocks.num_blocks

    served, cached = generate(target, "warm", prompt)
    # The last prompt token is always computed, so a prompt of whole blocks keeps one back.
    assert cached == min(blocks.num_blocks, (len(prompt) - 1) // 16) * 16
    assert served == computed


def test_tampered_values_never_reach_the_cache(engines):
    source, target = engines
    prompt = source.tokenizer.encode("A different opening line, " + TEXT)
    generate(source, "fill", prompt)
    blocks = source.export_prefix(prompt)
    poisoned = list(blocks.tensors)
    poisoned[0] = poisoned[0].clone()
    poisoned[0][0, 0, 0] = torch.inf
    with pytest.raises(TransferError, match="not finite"):
        target.import_prefix(dataclasses.replace(blocks, tensors=tuple(poisoned)))
    assert target.export_prefix(prompt) is None
