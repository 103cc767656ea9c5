"""KV cache sizing from a memory budget, and clear refusals when a model cannot fit."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from shoal.engine.config import EngineConfig, ModelSource
from shoal.engine.errors import ModelDoesNotFit
from shoal.engine.kv_budget import ROW_BUFFER_MAX_TOKENS, check_weights_fit, plan_kv_cache
from shoal.engine.models.config import ModelConfig

# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64 -> 23,040 bytes per token in bf16.
CONFIG = ModelConfig(architecture="llama", num_layers=30, hidden_size=576,
                     intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                     vocab_size=49152, max_position=8192)
PER_TOKEN = 2 * 30 * 3 * 64 * 2


@dataclass
class Loaded:
    cache_dtype: torch.dtype = torch.bfloat16
    layer_range: tuple[int, int] = (0, 30)


@pytest.fixture()
def source(tmp_path) -> ModelSource:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"\0" * 1000)
    return ModelSource(model_id="tiny", format="gguf", path=path)


def test_a_pipeline_rank_budgets_for_its_own_layers(source):
    config = EngineConfig(source=source, kv_cache_bytes=PER_TOKEN * 1024)
    whole = plan_kv_cache(config, CONFIG, Loaded())
    third = plan_kv_cache(config, CONFIG, Loaded(layer_range=(20, 30)))
    assert third.num_blocks == 3 * whole.num_blocks


def test_explicit_budget_sets_block_count_and_context(source):
    config = EngineConfig(source=source, kv_cache_bytes=128 * 16 * PER_TOKEN)
    plan = plan_kv_cache(config, CONFIG, Loaded())
    # An eighth of the budget is the decode row buffer; the paged blocks get the rest.
    assert plan.row_buffer_tokens == 16 * 16
    assert plan.num_blocks == 112
    assert plan.max_model_len == 112 * 16  # the pool holds fewer tokens than the model's 8192


def test_budget_counts_the_cache_dtype_not_the_compute_dtype(source):
    # On CPU a bf16 model keeps its cache in float32: the same bytes hold half the blocks.
    config = EngineConfig(source=source, kv_cache_bytes=128 * 16 * PER_TOKEN)
    plan = plan_kv_cache(config, CONFIG, Loaded(cache_dtype=torch.float32))
    assert (plan.num_blocks, plan.row_buffer_tokens) == (56, 8 * 16)


def test_the_decode_stage_is_capped(source):
    config = EngineConfig(source=source, kv_cache_bytes=2**20 * PER_TOKEN)
    plan = plan_kv_cache(config, CONFIG, Loaded())
    assert plan.row_buffer_tokens == ROW_BUFFER_MAX_TOKENS
    assert plan.num_blocks * 16 + plan.row_buffer_tokens <= 2**20


def test_default_capacity_is_full_contexts_for_every_slot_whatever_is_free(source, monkeypatch):
    config = EngineConfig(source=source, max_num_seqs=2)
    plan = plan_kv_cache(config, CONFIG, Loaded())
    # two full contexts, no more, and the decode row buffer beside them
    assert plan.num_blocks * 16 == 2 * 8192 and plan.row_buffer_tokens == 2 * 8192 // 8
    assert plan.max_model_len == 8192
    # Free memory does not enter it: a node that is nearly full plans the same pool.
    import psutil

    class Scarce:
        available = 10**6
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Scarce())
    assert plan_kv_cache(config, CONFIG, Loaded()) == plan


def test_kv_cache_memory_caps_the_capacity(source):
    config = EngineConfig(source=source, max_num_seqs=2, kv_cache_bytes=512 * PER_TOKEN)
    plan = plan_kv_cache(config, CONFIG, Loaded())
    assert (plan.num_blocks, plan.row_buffer_tokens) == (448 // 16, 64)


def test_a_budget_below_the_minimum_context_is_refused_clearly(source):
    config = EngineConfig(source=source, kv_cache_bytes=4096)
    with pytest.raises(ModelDoesNotFit, match="kv-cache-memory"):
        plan_kv_cache(config, CONFIG, Loaded())


def test_weights_larger_than_available_memory_are_refused_before_loading(source):
    check_weights_fit(source, available_bytes=10**6)
    with pytest.raises(ModelDoesNotFit, match="needs about"):
        check_weights_fit(source, available_bytes=500)
    with pytest.raises(ModelDoesNotFit, match="needs about"):  # the runner's share
        check_weights_fit(source, available_bytes=10**6, limit_bytes=500)


def test_released_slots_read_as_zeros_and_the_rest_is_kept():
    from shoal.engine.kv.tensors import release_slots

    cache = torch.ones(2, 4096, 64, dtype=torch.bfloat16)  # 128 bytes a slot: 32 a page
    released = release_slots([cache], 1024, 3072)
    # Whole pages inside each row's range: all of it but for at most a page at either end.
    assert 2 * (2048 * 128 - 2 * 4096) <= released <= 2 * 2048 * 128
    assert cache[:, 1024 + 64:3072 - 64].sum() == 0
    assert bool((cache[:, :1024] == 1).all()) and bool((cache[:, 3072:] == 1).all())
