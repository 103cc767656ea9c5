"""DeepSeek's latent KV cache: one row of kv_lora_rank + rope elements per token and layer
(the latent and the rotated rope key) in every precision, counted the same by the engine's
KV budget and the cluster's model facts, and attention over cached latents (a reused prefix)
giving what the same prompt gives computed afresh."""

from __future__ import annotations

import pytest
import torch
from forward_helpers import all_position_logits, chunk, greedy, step
from forward_helpers import load_checkpoint as load

from shoal.cluster.model_facts import model_facts_from_source
from shoal.engine.config import ModelSource
from shoal.engine.model_runner import ModelRunner
from shoal.engine.models.loader import kv_bytes_per_token, load_model

BLOCK = 4
BLOCKS = 16


def _allocated_bytes_per_token(runner: ModelRunner) -> int:
    """Bytes of every layer's cache tensors divided by their slots."""
    caches = runner.kv_caches
    slots = caches[0].shape[1]
    return sum(cache.numel() * cache.element_size() for cache in caches) // slots


@pytest.mark.parametrize("family", ["deepseek3", "deepseek2"])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_the_cache_holds_one_latent_row_per_token_and_layer(tiny_checkpoints, family,
                                                            kv_dtype):
    checkpoint = tiny_checkpoints[family]
    hf = checkpoint.hf_model.config
    latent = hf.kv_lora_rank + hf.qk_rope_head_dim
    loaded = load_model(ModelSource(family, "gguf", checkpoint.gguf_path), "float32",
                        kv_cache_dtype=kv_dtype)
    runner = ModelRunner(loaded, BLOCKS, BLOCK)
    element = torch.empty((), dtype=loaded.cache_dtype).element_size()
    per_token = hf.num_hidden_layers * latent * element
    assert all(cache.shape[0] == 1 for cache in runner.kv_caches)
    assert _allocated_bytes_per_token(runner) == per_token
    assert kv_bytes_per_token(loaded.config, loaded.cache_dtype) == per_token
    # The decompressed heads it replaces: a key and a padded value of nope + rope per head.
    decompressed = 2 * hf.num_attention_heads * (hf.qk_nope_head_dim + hf.qk_rope_head_dim)
    assert latent * 4 < decompressed
    # The cluster's placement counts the same bytes, from either file's header alone.
    for fmt, path in (("gguf", checkpoint.gguf_path), ("safetensors", checkpoint.safetensors_dir)):
        facts = model_facts_from_source(ModelSource(family, fmt, path))
        assert facts.kv_latent_dim == latent
        assert facts.kv_bytes_per_token_per_layer(element) * facts.n_layers == per_token


def test_an_int8_latent_row_keeps_its_scales_and_matches_the_budget(tiny_checkpoints):
    checkpoint = tiny_checkpoints["deepseek2"]
    loaded = load_model(ModelSource("ds", "gguf", checkpoint.gguf_path), "float32",
                        kv_cache_dtype="int8")
    runner = ModelRunner(loaded, BLOCKS, BLOCK)
    hf = checkpoint.hf_model.config
    latent = hf.kv_lora_rank + hf.qk_rope_head_dim
    # One bf16 scale per 16 channels, or one for the row where the width is not a multiple.
    scales = latent // 16 if latent % 16 == 0 else 1
    assert runner.kv_caches[0].shape == (1, BLOCKS * BLOCK, latent + 2 * scales)
    assert _allocated_bytes_per_token(runner) == kv_bytes_per_token(loaded.config, torch.int8)
    facts = model_facts_from_source(ModelSource("ds", "gguf", checkpoint.gguf_path))
    assert facts.kv_bytes_per_token_per_layer(1, scale_bytes=2) * facts.n_layers == \
        kv_bytes_per_token(loaded.config, torch.int8)


PROMPT = [50, 60, 70, 80, 90, 100, 110, 120, 10, 20, 30, 40, 45, 55, 65, 75, 85]


@pytest.mark.parametrize("family", ["deepseek3", "deepseek2"])
def test_a_reused_prefix_gives_what_the_prompt_gives_afresh(tiny_checkpoints, family):
    """float32. Request a computes the whole prompt; request b reuses a's first two blocks
    (8 latents it never computed) and computes the rest: the same logits at every position
    b computes (1e-5: the absorbed q of a row is a matmul over the chunk's rows) and the same
    greedy continuation."""
    loaded = load(tiny_checkpoints[family], "gguf")
    runner = ModelRunner(loaded, 3 * BLOCKS, BLOCK)
    fresh_blocks = list(range(BLOCKS))
    fresh = all_position_logits(runner, PROMPT, fresh_blocks)
    shared = 2 * BLOCK
    reused_blocks = fresh_blocks[:2] + list(range(BLOCKS, 2 * BLOCKS - 2))
    rest = PROMPT[shared:]
    reused = step(runner, chunk("b", rest, shared, reused_blocks))
    assert torch.allclose(reused[0], fresh[-1], atol=1e-5, rtol=0)
    # Greedy from here: b on the shared blocks, against a third request computed afresh.
    ours = [int(reused[0].argmax())]
    for _ in range(11):
        logits = step(runner, chunk("b", [ours[-1]], len(PROMPT) + len(ours) - 1,
                                    reused_blocks))
        ours.append(int(logits[0].argmax()))
    theirs = greedy(runner, PROMPT, 12, list(range(2 * BLOCKS, 3 * BLOCKS)))
    assert ours == theirs
