"""GGUF reading: metadata, canonical names, layer-range filtering, q/k un-permutation, quants."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from shoal.engine.errors import UnsupportedModel
from shoal.engine.weights.gguf import GGUFCheckpoint
from shoal.engine.weights.quant import RawTensor, q8_blocks


def test_metadata_becomes_model_config(tiny_checkpoints):
    config = GGUFCheckpoint(tiny_checkpoints["gemma3"].gguf_path).config
    assert (config.architecture, config.num_layers, config.hidden_size) == ("gemma3", 6, 64)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 1, 32)
    assert config.sliding_window == 5 and config.tie_embeddings and config.qk_norm
    assert config.layer_types == ("sliding",) * 5 + ("full",)
    llama = GGUFCheckpoint(tiny_checkpoints["llama"].gguf_path).config
    assert not llama.tie_embeddings and not llama.qk_norm and not llama.qkv_bias
    assert GGUFCheckpoint(tiny_checkpoints["qwen2"].gguf_path).config.qkv_bias


def test_stream_keeps_only_the_stage_tensors(tiny_checkpoints):
    checkpoint = GGUFCheckpoint(tiny_checkpoints["qwen3"].gguf_path)  # tied, 2 layers
    first = {name for name, _ in checkpoint.stream((0, 1))}
    last = {name for name, _ in checkpoint.stream((1, 2))}
    assert "embed.weight" in first and "norm.weight" not in first
    assert all(not n.startswith("layers.1.") for n in first)
    # The last stage of a tied model needs the embedding as its output head.
    assert {"embed.weight", "norm.weight"} <= last
    assert all(not n.startswith("layers.0.") for n in last)
    assert "layers.1.q_norm.weight" in last


def test_llama_q_rows_are_unpermuted(tiny_checkpoints):
    tiny = tiny_checkpoints["llama"]
    weights = dict(GGUFCheckpoint(tiny.gguf_path).stream())
    ours = weights["layers.0.q.weight"].dequantize()
    expected = tiny.gguf_reference.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(ours, expected)


def test_unknown_architecture_is_unsupported(tmp_path):
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_uint32("mamba.block_count", 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel, match="mamba"):
        GGUFCheckpoint(path)


def _quantized(values: np.ndarray, quant: str) -> RawTensor:
    data = gguf.quants.quantize(values, gguf.GGMLQuantizationType[quant])
    return RawTensor(values.shape, quant, data)


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "Q8_0", "Q5_0"])
def test_dequantize_reproduces_the_gguf_values(quant):
    rng = np.random.default_rng(0)
    raw = _quantized(rng.standard_normal((96, 256)).astype(np.float32), quant)
    expected = gguf.quants.dequantize(raw.data, gguf.GGMLQuantizationType[quant])
    assert torch.equal(raw.dequantize(), torch.from_numpy(np.array(expected, dtype=np.float32)))


def test_q8_blocks_are_exact():
    values = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    raw = _quantized(values, "Q8_0")
    q, scale = q8_blocks(raw)
    ours = (q.view(8, 2, 32).float() * scale[..., None]).view(8, 64)
    assert torch.equal(ours, raw.dequantize())
