"""The forward path on tiny random models of each family, against transformers in fp32."""

from __future__ import annotations

import random

import pytest
import tiny_models
import torch
from forward_helpers import all_position_logits, chunk, step
from tiny_models import DENSE_FAMILIES, FAMILIES, VOCAB

from shoal.engine.config import ModelSource
from shoal.engine.model_runner import ModelRunner
from shoal.engine.models.loader import load_model
from shoal.engine.scheduler_output import SchedulerOutput

PROMPT = [3, 17, 99, 42, 5, 77, 8, 120, 64, 33, 2, 91, 15]
BLOCK = 4


def shuffled_blocks(count: int = 16, seed: int = 0) -> list[int]:
    blocks = list(range(count))
    random.Random(seed).shuffle(blocks)
    return blocks


def load(checkpoint, fmt: str, dtype: str = "float32", layer_range=None,
         kv_cache_dtype: str = "auto", backend=None):
    """backend: the backend fixture (dtype -> Backend); None: the one load_model chooses."""
    path = checkpoint.gguf_path if fmt == "gguf" else checkpoint.safetensors_dir
    return load_model(ModelSource(checkpoint.family, fmt, path), dtype, layer_range=layer_range,
                      kv_cache_dtype=kv_cache_dtype,
                      backend=None if backend is None else backend(dtype))


def reference_logits(model, token_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_match_transformers(tiny_checkpoints, family, fmt):
    checkpoint = tiny_checkpoints[family]
    loaded = load(checkpoint, fmt)
    assert loaded.config.architecture == tiny_models.architecture(family)
    runner = ModelRunner(loaded, num_blocks=16, block_size=BLOCK)
    ours = all_position_logits(runner, PROMPT, shuffled_blocks())
    reference = checkpoint.hf_model if fmt == "safetensors" else checkpoint.gguf_reference
    expected = reference_logits(reference, PROMPT)
    assert ours.shape == (len(PROMPT), VOCAB)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_equals_one_shot(tiny_checkpoints, family, backend):
    loaded = load(tiny_checkpoints[family], "gguf", backend=backend)
    blocks = shuffled_blocks()
    one_shot = step(ModelRunner(loaded, 16, BLOCK), chunk("a", PROMPT, 0, blocks))
    runner = ModelRunner(loaded, 16, BLOCK)
    split = 7
    assert step(runner, chunk("a", PROMPT[:split], 0, blocks, sample=False)).shape[0] == 0
    chunked = step(runner, chunk("a", PROMPT[split:], split, blocks))
    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=1e-5)


# DeepSeek's layers on the bf16 kernels: its latent attention attends each decode alone
# (backends/paged_attention.py), but its float32 router's matmul (layers/experts.py) sums
# in an order that follows the step's row count, and bf16 rounding after it can move a
# batched row by a bf16 step: measured up to 0.005 (deepseek2, from its second step on).
BATCH_TOLERANCE = {("cpu-kernels", "deepseek2"): 0.02, ("cpu-kernels", "deepseek3"): 0.02}

# Steps of the batched decode tests: which of the three requests decode together.
STEADY = [(0, 1, 2)] * 10
CHANGING = [(0, 1, 2), (0, 1, 2), (0, 2), (0, 1, 2), (1, 2), (1, 2), (0, 1, 2), (0, 1, 2)]


@pytest.mark.parametrize("row_buffer_tokens, schedule", [(0, STEADY), (64, STEADY), (64, CHANGING)],
                         ids=["gather", "row-buffer", "row-buffer-batch-changes"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_decode_equals_one_at_a_time(tiny_checkpoints, family, row_buffer_tokens, schedule,
                                             backend):
    # The row buffer holds 64 // 3 = 21 tokens per row: the steady run outgrows it (and gathers).
    loaded = load(tiny_checkpoints[family], "gguf", backend=backend)
    prompts = [PROMPT, PROMPT[:4], PROMPT[2:11]]  # different lengths; gemma window is 5
    tables = [shuffled_blocks(16, seed)[:8] for seed in range(3)]
    tables = [[b + 16 * i for b in t] for i, t in enumerate(tables)]  # disjoint blocks

    def prefill(runner):
        return [step(runner, chunk(str(i), p, 0, tables[i])) for i, p in enumerate(prompts)]

    alone = ModelRunner(loaded, 48, BLOCK)
    batched = ModelRunner(loaded, 48, BLOCK, row_buffer_tokens=row_buffer_tokens)
    tolerance = BATCH_TOLERANCE.get((loaded.module.plan.backend.name, family), 1e-5)
    firsts = prefill(alone)
    prefill(batched)
    tokens = [int(f[0].argmax()) for f in firsts]
    lengths = [len(p) for p in prompts]
    for members in schedule:
        chunks = [chunk(str(i), [tokens[i]], lengths[i], tables[i]) for i in members]
        together = step(batched, *chunks)
        separate = torch.cat([step(alone, c) for c in chunks])
        torch.testing.assert_close(together, separate, atol=tolerance, rtol=tolerance)
        assert torch.equal(together.argmax(-1), separate.argmax(-1))
        for i, row in zip(members, together):
            tokens[i] = int(row.argmax())
            lengths[i] += 1


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3moe"])
def test_two_stages_chained_equal_the_whole_model(tiny_checkpoints, family, backend):
    checkpoint = tiny_checkpoints[family]
    whole = load(checkpoint, "gguf", backend=backend)
    split = whole.config.num_layers // 2
    first = load(checkpoint, "gguf", layer_range=(0, split), backend=backend)
    second = load(checkpoint, "gguf", layer_range=(split, whole.config.num_layers),
                  backend=backend)
    assert first.module.head is None and second.module.embedding is None
    blocks = shuffled_blocks()
    expected = step(ModelRunner(whole, 16, BLOCK), chunk("a", PROMPT, 0, blocks))
    stage_one, stage_two = ModelRunner(first, 16, BLOCK), ModelRunner(second, 16, BLOCK)
    hidden = step(stage_one, chunk("a", PROMPT, 0, blocks))
    assert hidden.shape == (len(PROMPT), whole.config.hidden_size)
    from shoal.engine.scheduler_output import SchedulerOutput
    logits = stage_two.execute(SchedulerOutput((chunk("a", PROMPT, 0, blocks),)), hidden)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


# A mixture of experts may route a near-tie to other experts in bf16, which moves that
# row's logits far: test_moe.py checks those families' agreement by the logits' margin.
@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_bfloat16_stays_close_to_fp32(tiny_checkpoints, family, backend):
    from shoal.engine.backends.packing import QuantLinear
    from shoal.engine.models.layers.linear import DenseLinear

    checkpoint = tiny_checkpoints[family]
    fast = load(checkpoint, "gguf", dtype="bfloat16", backend=backend)
    kinds = {type(m) for m in fast.module.modules()}
    if fast.module.plan.backend.packs_weights:
        assert QuantLinear in kinds and DenseLinear not in kinds  # every GGUF type packed
    else:
        assert DenseLinear in kinds and QuantLinear not in kinds
    assert fast.cache_dtype == torch.bfloat16
    blocks = shuffled_blocks()
    ours = all_position_logits(ModelRunner(fast, 16, BLOCK), PROMPT, blocks)
    exact = all_position_logits(ModelRunner(load(checkpoint, "gguf"), 16, BLOCK), PROMPT, blocks)
    assert ours.dtype == torch.float32
    cosine = torch.nn.functional.cosine_similarity(ours, exact, dim=-1)
    assert cosine.min() > 0.99


@pytest.mark.parametrize("kv_cache_dtype, expected", [("auto", torch.bfloat16),
                                                      ("float32", torch.float32)])
def test_kv_cache_dtype_follows_the_setting(tiny_checkpoints, kv_cache_dtype, expected,
                                            backend):
    loaded = load(tiny_checkpoints["llama"], "gguf", dtype="bfloat16",
                  kv_cache_dtype=kv_cache_dtype, backend=backend)
    runner = ModelRunner(loaded, 4, BLOCK)
    assert all(cache.dtype == expected for cache in runner.kv_caches)
    assert load(tiny_checkpoints["llama"], "gguf").cache_dtype == torch.float32  # fp32 compute


def test_packed_model_holds_about_its_file_size(tiny_checkpoints):
    # Packed weights keep the file's bits (plus a little layout): no dense copies.
    checkpoint = tiny_checkpoints["llama"]
    fast = load(checkpoint, "gguf", dtype="bfloat16")
    if not fast.module.plan.backend.packs_weights:
        pytest.skip("no packed-weight kernel on this CPU")
    file_bytes = checkpoint.gguf_path.stat().st_size
    assert fast.weight_bytes <= 1.2 * file_bytes
    assert load(checkpoint, "gguf").weight_bytes > 2 * fast.weight_bytes  # fp32: dequantized


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3moe"])
def test_a_prompts_logits_do_not_depend_on_its_chunks(tiny_checkpoints, family):
    # In bf16 too: linear layers compute each row alone and each prompt row attends on its
    # own, so however the prompt is split (or cached), its last row's logits are the same bits.
    fast = load(tiny_checkpoints[family], "gguf", dtype="bfloat16")
    if not fast.module.plan.backend.packs_weights:
        pytest.skip("no packed-weight kernel on this CPU")
    blocks = shuffled_blocks(96)
    prompt = (PROMPT * 20)[:250]  # long enough for torch's attention to split its work
    whole = step(ModelRunner(fast, 96, BLOCK), chunk("a", prompt, 0, blocks))
    for cut in (5, 100, 200, 249):
        runner = ModelRunner(fast, 96, BLOCK)
        step(runner, chunk("a", prompt[:cut], 0, blocks, sample=False))
        split = step(runner, chunk("a", prompt[cut:], cut, blocks, prompt=True))
        assert torch.equal(split, whole), cut


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3moe"])
def test_the_last_layer_goes_on_with_the_sampled_rows_alone(tiny_checkpoints, family):
    """A prefill's last layer runs its output projection and MLP on the rows whose logits
    are sampled only; those rows keep the bits that computing every row gives them, and the
    cache holds every row's keys and values (the next token attends to them alike)."""
    fast = load(tiny_checkpoints[family], "gguf", dtype="bfloat16")
    if not fast.module.plan.backend.packs_weights:
        pytest.skip("no packed-weight kernel on this CPU")
    blocks = shuffled_blocks()
    pruned_runner, full_runner = ModelRunner(fast, 16, BLOCK), ModelRunner(fast, 16, BLOCK)
    pruned = step(pruned_runner, chunk("a", PROMPT, 0, blocks))
    every = all_position_logits(full_runner, PROMPT, blocks)
    assert pruned.shape == (1, VOCAB)
    assert torch.equal(pruned[0], every[-1])
    with torch.inference_mode():  # the model itself hands back the sampled row alone
        scratch = ModelRunner(fast, 16, BLOCK)
        part = scratch.prepare(SchedulerOutput(chunks=(chunk("b", PROMPT, 0, blocks),))).parts[0]
        assert fast.module(part.token_ids, part.meta, scratch.kv_caches).shape[0] == 1
    slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(PROMPT))])
    for ours, theirs in zip(pruned_runner.kv_caches, full_runner.kv_caches):
        assert torch.equal(ours[:, slots], theirs[:, slots])
    token = int(pruned[0].argmax())
    after = [step(r, chunk("a", [token], len(PROMPT), blocks)) for r in (pruned_runner,
                                                                         full_runner)]
    assert torch.equal(after[0], after[1])


def test_a_tied_table_the_head_splits_is_never_packed(tiny_checkpoints, monkeypatch):
    """Gemma 3's tied Q8_0 table goes straight from the file's bytes to the head's split
    table: the embedding packs nothing first (it would drop it at once)."""
    from shoal.engine.backends import head_estimates as head_module
    from shoal.engine.backends.cpu_kernels import CpuKernels

    monkeypatch.setattr(head_module, "ESTIMATE_MIN_WEIGHTS", 0)
    packed_shapes = []
    real_pack = CpuKernels.pack  # what an embedding packs its table with

    def counting_pack(backend, raw):
        packed_shapes.append(raw.shape)
        return real_pack(backend, raw)

    monkeypatch.setattr(CpuKernels, "pack", counting_pack)
    fast = load(tiny_checkpoints["gemma3"], "gguf", dtype="bfloat16")
    if not fast.module.plan.backend.packs_weights:
        pytest.skip("no packed-weight kernel on this CPU")
    model = fast.module
    if not isinstance(model.head, head_module.SplitHead):
        pytest.skip("no split estimate kernel on this CPU")
    assert packed_shapes == []
    assert model.embedding.split is model.head.table and model.embedding.packed is None
    runner = ModelRunner(fast, 16, BLOCK)
    logits = step(runner, chunk("a", PROMPT, 0, shuffled_blocks()))
    assert logits.shape == (1, VOCAB) and torch.isfinite(logits).all()
