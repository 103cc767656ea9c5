"""The int8 KV cache (--kv-cache-dtype int8) on tiny random models: its row layout, the
same bits from the compiled kernel and the Python path, every attention path reading it,
and the memory it saves. Quality on real models: test_kv_int8_quality.py."""

from __future__ import annotations

import pytest
import tiny_models
import torch
from forward_helpers import all_position_logits, chunk, step
from test_fused_decode import BLOCKS_PER_ROW, PROMPTS, assert_decode_matches, decode_step
from test_fused_decode import prefill as prefill_rows
from test_models import BLOCK, PROMPT, load, shuffled_blocks

from shoal.engine.config import EngineConfig, ModelSource
from shoal.engine.kv.quant import dequantize, quantize, row_bytes, row_width
from shoal.engine.kv.tensors import allocate_kv_cache
from shoal.engine.kv_budget import kv_bytes_per_block, plan_kv_cache
from shoal.engine.model_runner import ModelRunner
from shoal.engine.models.loader import kv_bytes_per_token


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """A llama of head size 64: rows of four scale groups (the tiny families' heads of 16
    and 32 take one and two)."""
    return tiny_models.build("llama", tmp_path_factory.mktemp("wide"), num_attention_heads=2,
                             num_key_value_heads=1, head_dim=64)


def test_a_row_is_its_values_then_a_scale_per_16_channels():
    x = torch.randn(5, 6, 64) * torch.linspace(0.01, 10, 6)[:, None]  # [T, 2 H_kv, D]
    x[..., 7] = 50 * x.abs().amax(-1)  # an outlier channel: only its group's scale grows
    x[0, 0] = 0.0  # a row of zeros
    rows = quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 6, 72)
    scale = rows[..., 64:].contiguous().view(torch.bfloat16).float()  # [5, 6, 4]
    expected = (x.unflatten(-1, (4, 16)).abs().amax(-1) / 127).to(torch.bfloat16).float()
    assert torch.equal(scale, expected)
    assert (scale[1:, :, 0] > 10 * scale[1:, :, 1:].amax(-1)).all()
    assert rows[..., :64].abs().max() == 127  # absmax reaches the last level
    back = dequantize(rows, 64)
    assert back.shape == x.shape and torch.equal(back[0, 0], torch.zeros(64))
    # Each value within half a level of its group, and the bf16 scale's rounding (2^-9).
    step = scale.repeat_interleave(16, dim=-1)
    assert ((back - x).abs() <= step * (0.5 + 127 / 512) + 1e-6).all()
    # Head sizes that are not a multiple of 16 take one scale per row.
    assert quantize(torch.randn(3, 40)).shape == (3, 42)
    assert row_bytes(40, torch.int8) == 42 and row_bytes(256, torch.int8) == 288


def test_int8_rows_take_about_half_of_bf16s_bytes(tiny_checkpoints):
    loaded = load(tiny_checkpoints["llama"], "gguf", dtype="bfloat16", kv_cache_dtype="int8")
    config = loaded.config  # 2 layers
    caches = {dtype: allocate_kv_cache(config, 2, 8, BLOCK, dtype)
              for dtype in (torch.bfloat16, torch.int8)}
    per_token = {dtype: sum(c.nbytes for c in cache) / (8 * BLOCK)
                 for dtype, cache in caches.items()}
    for dtype, measured in per_token.items():
        assert measured == kv_bytes_per_token(config, dtype, num_layers=2)
    # What /api/ps reports a runner's blocks to hold.
    assert kv_bytes_per_block(loaded, BLOCK) == per_token[torch.int8] * BLOCK
    d = config.head_dim  # 16: one scale
    assert per_token[torch.int8] / per_token[torch.bfloat16] == (d + 2) / (2 * d)
    assert row_bytes(64, torch.int8) / row_bytes(64, torch.bfloat16) == 72 / 128


def test_the_same_memory_holds_more_tokens_by_the_row_sizes_ratio(tiny_checkpoints):
    checkpoint = tiny_checkpoints["llama"]
    source = ModelSource("llama", "gguf", checkpoint.gguf_path)
    tokens = {}
    for kv_dtype in ("bfloat16", "int8"):
        loaded = load(checkpoint, "gguf", dtype="bfloat16", kv_cache_dtype=kv_dtype)
        # Enough slots that the model's need is above the budget: the budget decides.
        config = EngineConfig(source=source, kv_cache_bytes=4 * 2**20, kv_cache_dtype=kv_dtype,
                              max_num_seqs=1024)
        plan = plan_kv_cache(config, loaded.config, loaded)
        tokens[kv_dtype] = plan.num_blocks * config.block_size + plan.row_buffer_tokens
    d = loaded.config.head_dim
    assert tokens["int8"] / tokens["bfloat16"] == pytest.approx(2 * d / (d + 2), rel=0.01)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "qwen3", "wide-heads"])
def test_kernel_decode_over_int8_matches_the_python_path(kernel, tiny_checkpoints, wide_heads,
                                                         family):
    checkpoint = wide_heads if family == "wide-heads" else tiny_checkpoints[family]
    assert_decode_matches(checkpoint, PROMPTS, kv_cache_dtype="int8")


@pytest.mark.parametrize("family", ["llama", "wide-heads"])
def test_kernel_and_python_path_write_the_same_int8_rows(kernel, tiny_checkpoints, wide_heads,
                                                         family):
    checkpoint = wide_heads if family == "wide-heads" else tiny_checkpoints[family]
    runners = {}
    for fused in (True, False):
        loaded = load(checkpoint, "gguf", dtype="bfloat16", kv_cache_dtype="int8")
        loaded.module.fused_decode_allowed = fused
        runners[fused] = ModelRunner(loaded, BLOCKS_PER_ROW * 3, BLOCK)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    for runner in runners.values():
        prefill_rows(runner, tables, PROMPTS[:3])
    lengths = [len(p) for p in PROMPTS[:3]]
    (_, on_kernel), (_, on_python) = (decode_step(runners[f], [1, 2, 3], tables, lengths)
                                      for f in (True, False))
    assert on_kernel and not on_python
    for row, n in enumerate(lengths):
        slot = tables[row][n // BLOCK] * BLOCK + n % BLOCK
        for ours, theirs in zip(runners[True].kv_caches, runners[False].kv_caches):
            values = ours[:, slot, :runners[True].config.head_dim]
            assert ours.dtype == torch.int8 and values.abs().max() == 127
            assert torch.equal(ours[:, slot], theirs[:, slot])


@pytest.mark.parametrize("family", ["llama", "gemma3", "wide-heads"])
def test_int8_logits_stay_close_to_bf16s(kernel, tiny_checkpoints, wide_heads, family):
    """Prompt rows (the prompt kernel), then decode rows (the fused kernel) fed the same
    tokens, over int8 and over bf16."""
    checkpoint = wide_heads if family == "wide-heads" else tiny_checkpoints[family]
    runners = {}
    for kv_dtype in ("bfloat16", "int8"):
        loaded = load(checkpoint, "gguf", dtype="bfloat16", kv_cache_dtype=kv_dtype)
        runners[kv_dtype] = ModelRunner(loaded, 16, BLOCK)
    blocks = shuffled_blocks()
    logits = {kv: [all_position_logits(runner, PROMPT, blocks)]
              for kv, runner in runners.items()}
    tokens = [int(logits["bfloat16"][0][-1].argmax())]
    for position in range(len(PROMPT), len(PROMPT) + 6):
        for kv, runner in runners.items():
            logits[kv].append(step(runner, chunk("a", tokens[-1:], position, blocks)))
        tokens.append(int(logits["bfloat16"][-1][0].argmax()))
    ours, theirs = torch.cat(logits["int8"]), torch.cat(logits["bfloat16"])
    assert ours.shape == theirs.shape == (len(PROMPT) + 6, theirs.shape[1])
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=-1).min() > 0.995


@pytest.mark.parametrize("family", ["llama", "gemma3", "wide-heads"])
def test_python_attention_reads_int8_in_every_layout(tiny_checkpoints, wide_heads, family):
    """float32 compute has no kernels: attention gathers, slices or buffers int8 rows and
    dequantizes only those. Its logits follow a float32 cache's closely."""
    checkpoint = wide_heads if family == "wide-heads" else tiny_checkpoints[family]
    results = {}
    for kv_dtype in ("float32", "int8"):
        loaded = load(checkpoint, "gguf", kv_cache_dtype=kv_dtype)  # float32 compute
        assert (not loaded.module.plan.backend.packs_weights
                and loaded.cache_dtype == getattr(torch, kv_dtype))
        runner = ModelRunner(loaded, 40, BLOCK, row_buffer_tokens=64)
        blocks = [shuffled_blocks(20, seed=1), list(range(20, 40))]
        # Request a: prefill in two chunks over scattered blocks (a gather); request b: one
        # prefill over consecutive blocks (a slice); then decodes of both (the row buffer).
        step(runner, chunk("a", PROMPT[:6], 0, blocks[0], sample=False))
        first = [step(runner, chunk("a", PROMPT[6:], 6, blocks[0])),
                 step(runner, chunk("b", PROMPT, 0, blocks[1]))]
        rows = []
        lengths = [len(PROMPT)] * 2
        tokens = [int(first[0][0].argmax()), int(first[1][0].argmax())]
        for _ in range(4):
            out = step(runner, *(chunk(r, [t], n, b) for r, t, n, b
                                 in zip("ab", tokens, lengths, blocks)))
            rows.append(out)
            lengths = [n + 1 for n in lengths]
        assert runner.row_buffer is not None and runner.kv_caches[0].shape[-1] == row_width(
            loaded.config.head_dim, loaded.cache_dtype)
        results[kv_dtype] = torch.cat(first + rows)
    ours, theirs = results["int8"], results["float32"]
    assert torch.isfinite(ours).all()
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=-1).min() > 0.995


def test_an_unknown_kv_cache_dtype_names_the_choices(tiny_checkpoints):
    source = ModelSource("llama", "gguf", tiny_checkpoints["llama"].gguf_path)
    with pytest.raises(ValueError, match="auto, bfloat16, float32, int8, not 'int4'"):
        EngineConfig(source=source, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="auto, bfloat16, float32, int8"):
        load(tiny_checkpoints["llama"], "gguf", kv_cache_dtype="fp8")
