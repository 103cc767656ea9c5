"""Tensor-parallel slices of real checkpoint tensors: exact, and still quantized when cut on
block boundaries; which heads each rank computes."""

from __future__ import annotations

import pytest
import torch
from tokenizer_fixtures import gemma3_path, smollm2_path

from shoal.engine.parallel.shard import TensorShard, head_shard, take_columns, take_rows
from shoal.engine.weights.gguf import GGUFCheckpoint


def first_layer(path) -> dict:
    return dict(GGUFCheckpoint(path).stream((0, 1)))


@pytest.mark.parametrize("path_of, name, cut", [
    (smollm2_path, "layers.0.o.weight", 288),      # Q4_1, 32-weight blocks
    (smollm2_path, "layers.0.down.weight", 768),
    (gemma3_path, "layers.0.o.weight", 512),       # K-quant, 256-weight blocks
])
def test_column_halves_stay_quantized_and_exact(path_of, name, cut):
    raw = first_layer(path_of())[name]
    full = raw.dequantize()
    left, right = take_columns(raw, 0, cut), take_columns(raw, cut, raw.shape[1])
    assert left.quant == right.quant == raw.quant
    assert torch.equal(left.dequantize(), full[:, :cut])
    assert torch.equal(right.dequantize(), full[:, cut:])


def test_cuts_inside_a_block_fall_back_to_dense_and_rows_are_exact():
    raw = first_layer(smollm2_path())["layers.0.q.weight"]
    full = raw.dequantize()
    odd = take_columns(raw, 0, 100)
    assert odd.quant == "dense" and torch.equal(odd.dequantize(), full[:, :100])
    rows = take_rows(raw, 64, 192)
    assert rows.quant == raw.quant and torch.equal(rows.dequantize(), full[64:192])
    with pytest.raises(ValueError):
        take_rows(raw, 10, 5000)


def test_head_shards_split_or_replicate_kv_heads():
    # SmolLM2: 9 heads in 3 KV groups; over 3 ranks one group each, over 2 ranks 2 and 1.
    shards = [head_shard(9, 3, TensorShard(r, 3)) for r in range(3)]
    assert [(s.q_start, s.q_end, s.kv_start, s.kv_end) for s in shards] == [
        (0, 3, 0, 1), (3, 6, 1, 2), (6, 9, 2, 3)]
    halves = [head_shard(9, 3, TensorShard(r, 2)) for r in range(2)]
    assert [(s.q_start, s.q_end, s.kv_start, s.kv_end) for s in halves] == [
        (0, 6, 0, 2), (6, 9, 2, 3)]
    # Gemma 3 270M: 4 heads, 1 KV head over 2 ranks: the KV head is replicated.
    gemma = [head_shard(4, 1, TensorShard(r, 2)) for r in range(2)]
    assert [(s.q_start, s.q_end, s.kv_start, s.kv_end) for s in gemma] == [
        (0, 2, 0, 1), (2, 4, 0, 1)]
    # 8 heads, 2 KV heads over 4 ranks: two ranks share each KV head.
    assert [head_shard(8, 2, TensorShard(r, 4)).kv_start for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="cannot be split"):
        head_shard(6, 2, TensorShard(0, 4))  # groups of 3 q heads over 2 ranks each


def test_near_equal_splits():
    assert [TensorShard(r, 2).split(1536, "w") for r in range(2)] == [(0, 768), (768, 1536)]
    assert [TensorShard(r, 3).split(10, "w") for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError, match="fewer"):
        TensorShard(0, 4).split(3, "w")
