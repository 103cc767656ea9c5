"""The forward path on tiny random models of each family, against transformers in fp32."""

from __future__ import annotations

import random

import pytest
import torch
from forward_helpers import all_position_logits, chunk, step
from tiny_models import FAMILIES, VOCAB

from shoal.engine.config import ModelSource
from shoal.engine.model_runner import ModelRunner
from shoal.engine.models.loader import load_model

PROMPT = [3, 17, 99, 42, 5, 77, 8, 120, 64, 33, 2, 91, 15]
BLOCK = 4


def shuffled_blocks(count: int = 16, seed: int = 0) -> list[int]:
    blocks = list(range(count))
    random.Random(seed).shuffle(blocks)
    return blocks


def load(checkpoint, fmt: str, dtype: str = "float32", layer_range=None):
    path = checkpoint.gguf_path if fmt == "gguf" else checkpoint.safetensors_dir
    return load_model(ModelSource(checkpoint.family, fmt, path), dtype, layer_range=layer_range)


def reference_logits(model, token_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_match_transformers(tiny_checkpoints, family, fmt):
    checkpoint = tiny_checkpoints[family]
    loaded = load(checkpoint, fmt)
    assert loaded.config.architecture == family
    runner = ModelRunner(loaded, num_blocks=16, block_size=BLOCK)
    ours = all_position_logits(runner, PROMPT, shuffled_blocks())
    reference = checkpoint.hf_model if fmt == "safetensors" else checkpoint.gguf_reference
    expected = reference_logits(reference, PROMPT)
    assert ours.shape == (len(PROMPT), VOCAB)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_equals_one_shot(tiny_checkpoints, family):
    loaded = load(tiny_checkpoints[family], "gguf")
    blocks = shuffled_blocks()
    one_shot = step(ModelRunner(loaded, 16, BLOCK), chunk("a", PROMPT, 0, blocks))
    runner = ModelRunner(loaded, 16, BLOCK)
    split = 7
    assert step(runner, chunk("a", PROMPT[:split], 0, blocks, sample=False)).shape[0] == 0
    chunked = step(runner, chunk("a", PROMPT[split:], split, blocks))
    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=1e-5)


# Steps of the batched decode tests: which of the three requests decode together.
STEADY = [(0, 1, 2)] * 10
CHANGING = [(0, 1, 2), (0, 1, 2), (0, 2), (0, 1, 2), (1, 2), (1, 2), (0, 1, 2), (0, 1, 2)]


@pytest.mark.parametrize("stage_tokens, schedule", [(0, STEADY), (64, STEADY), (64, CHANGING)],
                         ids=["gather", "stage", "stage-batch-changes"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_decode_equals_one_at_a_time(tiny_checkpoints, family, stage_tokens, schedule):
    # The stage holds 64 // 3 = 21 tokens per row: the steady run outgrows it (and gathers).
    loaded = load(tiny_checkpoints[family], "gguf")
    prompts = [PROMPT, PROMPT[:4], PROMPT[2:11]]  # different lengths; gemma window is 5
    tables = [shuffled_blocks(16, seed)[:8] for seed in range(3)]
    tables = [[b + 16 * i for b in t] for i, t in enumerate(tables)]  # disjoint blocks

    def prefill(runner):
        return [step(runner, chunk(str(i), p, 0, tables[i])) for i, p in enumerate(prompts)]

    alone = ModelRunner(loaded, 48, BLOCK)
    batched = ModelRunner(loaded, 48, BLOCK, stage_tokens=stage_tokens)
    firsts = prefill(alone)
    prefill(batched)
    tokens = [int(f[0].argmax()) for f in firsts]
    lengths = [len(p) for p in prompts]
    for members in schedule:
        chunks = [chunk(str(i), [tokens[i]], lengths[i], tables[i]) for i in members]
        together = step(batched, *chunks)
        separate = torch.cat([step(alone, c) for c in chunks])
        torch.testing.assert_close(together, separate, atol=1e-5, rtol=1e-5)
        for i, row in zip(members, together):
            tokens[i] = int(row.argmax())
            lengths[i] += 1


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_two_stages_chained_equal_the_whole_model(tiny_checkpoints, family):
    checkpoint = tiny_checkpoints[family]
    whole = load(checkpoint, "gguf")
    split = whole.config.num_layers // 2
    first = load(checkpoint, "gguf", layer_range=(0, split))
    second = load(checkpoint, "gguf", layer_range=(split, whole.config.num_layers))
    assert first.module.head is None and second.module.embedding is None
    blocks = shuffled_blocks()
    expected = step(ModelRunner(whole, 16, BLOCK), chunk("a", PROMPT, 0, blocks))
    stage_one, stage_two = ModelRunner(first, 16, BLOCK), ModelRunner(second, 16, BLOCK)
    hidden = step(stage_one, chunk("a", PROMPT, 0, blocks))
    assert hidden.shape == (len(PROMPT), whole.config.hidden_size)
    from shoal.engine.scheduler_output import SchedulerOutput
    logits = stage_two.execute(SchedulerOutput((chunk("a", PROMPT, 0, blocks),)), hidden)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_quantized_path_stays_close_to_fp32(tiny_checkpoints):
    checkpoint = tiny_checkpoints["llama"]
    fast = load(checkpoint, "gguf", dtype="bfloat16")
    kinds = {type(m).__name__ for m in fast.module.modules()}
    assert {"Int4Linear", "Int8Linear"} <= kinds  # Q4_1/Q4_0 kept 4-bit, Q8_0 head as int8
    blocks = shuffled_blocks()
    ours = all_position_logits(ModelRunner(fast, 16, BLOCK), PROMPT, blocks)
    exact = all_position_logits(ModelRunner(load(checkpoint, "gguf"), 16, BLOCK), PROMPT, blocks)
    assert ours.dtype == torch.float32
    cosine = torch.nn.functional.cosine_similarity(ours, exact, dim=-1)
    assert cosine.min() > 0.99


def test_int8_linear_many_rows_match_the_weight_only_kernel():
    from shoal.engine.models.layers.linear import QUANT_MAX_ROWS, Int8Linear
    from shoal.engine.weights.quant import int8_rows

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator)
    q, scale = int8_rows(weight)
    layer = Int8Linear(q, scale.to(torch.bfloat16))
    x = torch.randn(QUANT_MAX_ROWS + 12, 64, generator=generator).to(torch.bfloat16)
    x[:, 3] *= 20  # an outlier channel, as real activations have
    many = layer(x)  # int8 activations path
    one_by_one = torch.cat([layer(row[None]) for row in x])  # weight-only kernel
    assert many.dtype == torch.bfloat16 and many.shape == (x.shape[0], 96)
    torch.testing.assert_close(many.float(), one_by_one.float(), atol=0.05, rtol=0.02)


def test_quantized_layer_runs_many_rows_on_its_dense_copy():
    import numpy as np

    from shoal.engine.models.layers.linear import (
        QUANT_MAX_ROWS,
        WeightPlan,
        build_linear,
    )
    from shoal.engine.weights.quant import RawTensor

    generator = torch.Generator().manual_seed(0)
    rows, cols = 128, 64  # Q4_1 blocks: fp16 d, fp16 m, 16 bytes of nibbles per 32 weights
    blocks = np.zeros((rows, cols // 32, 20), dtype=np.uint8)
    header = torch.rand(rows, cols // 32, 2, generator=generator) * torch.tensor([0.05, -0.4])
    blocks[:, :, :4] = header.to(torch.float16).numpy().view(np.uint8).reshape(rows, -1, 4)
    blocks[:, :, 4:] = torch.randint(0, 256, (rows, cols // 32, 16), generator=generator,
                                     dtype=torch.uint8).numpy()
    raw = RawTensor((rows, cols), "Q4_1", blocks.reshape(rows, -1))
    plan = WeightPlan(torch.bfloat16, torch.device("cpu"), keep_quantized=True,
                      dense_for_batches=True)
    layer = build_linear([raw], None, plan)
    assert layer.dense is not None
    x = torch.randn(QUANT_MAX_ROWS + 4, cols, generator=generator).to(torch.bfloat16)
    many = layer(x)  # the dense copy
    one_by_one = torch.cat([layer(row[None]) for row in x])  # the 4-bit kernel
    exact = x.float() @ raw.dequantize().t()
    torch.testing.assert_close(many.float(), exact, atol=0.05, rtol=0.02)
    torch.testing.assert_close(one_by_one.float(), exact, atol=0.05, rtol=0.02)
