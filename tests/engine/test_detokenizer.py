"""Incremental detokenization and stop strings."""

from __future__ import annotations

import pytest
from tokenizer_fixtures import (
    gemma3_path,
    smollm2_path,
    tiny_byte_level_metadata,
    tiny_sentencepiece_metadata,
)

from shoal.engine.tokenizer.detokenizer import IncrementalDetokenizer, StopChecker
from shoal.engine.tokenizer.gguf_vocab import build_tokenizer, tokenizer_info
from shoal.engine.tokenizer.tokenizer import Tokenizer

TEXTS = ["Emoji 😀🚀👍🏽 and 🇫🇷!", "中文测试：你好，世界！", "héllo wörld", "  two  spaces\n\nnext"]


def _tiny(metadata: dict) -> Tokenizer:
    return Tokenizer(build_tokenizer(metadata), tokenizer_info(metadata))


def _stream(tokenizer, ids, prompt=()):
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    deltas = [detok.add(token_id) for token_id in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("make", [tiny_byte_level_metadata, tiny_sentencepiece_metadata])
@pytest.mark.parametrize("text", TEXTS)
def test_byte_split_characters_never_yield_replacement(make, text):
    tokenizer = _tiny(make())
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # mostly single bytes: characters really are split
    deltas = _stream(tokenizer, ids)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_leading_space_survives_with_prompt_context():
    tokenizer = _tiny(tiny_sentencepiece_metadata(architecture="llama"))
    prompt = tokenizer.encode("hi", add_special_tokens=False)
    ids = tokenizer.encode("hi hi", add_special_tokens=False)
    assert "".join(_stream(tokenizer, ids[1:], prompt=prompt)) == " hi"


def test_special_tokens_are_skipped_or_kept():
    tokenizer = _tiny(tiny_byte_level_metadata())
    ids = [1] + tokenizer.encode("hello", add_special_tokens=False) + [2]
    assert "".join(_stream(tokenizer, ids)) == "hello"
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(detok.add(i) for i in ids) == "<|im_start|>hello<|im_end|>"


def test_invalid_bytes_are_released_eventually():
    tokenizer = _tiny(tiny_byte_level_metadata())
    lone = tokenizer.encode("😀", add_special_tokens=False)[0]  # first byte of 4, forever alone
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(detok.add(lone) for _ in range(12))
    assert out.startswith("\ufffd")
    assert detok.text == out


@pytest.mark.slow
@pytest.mark.parametrize("path_of", [smollm2_path, gemma3_path])
def test_real_tokenizers_stream_exactly(path_of, tmp_path):
    from shoal.engine.config import ModelSource

    tokenizer = Tokenizer.load(ModelSource("m", "gguf", path_of()), cache_dir=tmp_path)
    prompt = tokenizer.encode("Say something:")
    for text in TEXTS + ["def f(x):\n    return x ** 2  # ✓"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        deltas = _stream(tokenizer, ids, prompt=prompt)
        assert all("\ufffd" not in delta for delta in deltas)
        assert "".join(deltas) == tokenizer.decode(ids) == text


# -- StopChecker -------------------------------------------------------------------------


def test_stop_string_split_over_three_feeds():
    checker = StopChecker(("STOP",))
    assert checker.feed("hello S") == ("hello ", False)
    assert checker.feed("T") == ("", False)
    assert checker.feed("OP and more") == ("", True)
    assert checker.stop_string == "STOP"
    assert checker.feed("later") == ("", True)
    assert checker.flush() == ""


def test_partial_prefix_is_released_when_it_stops_matching():
    checker = StopChecker(("</end>",))
    assert checker.feed("a </e") == ("a ", False)
    assert checker.feed("x") == ("</ex", False)
    assert checker.feed("</") == ("", False)
    assert checker.flush() == "</"


def test_text_before_stop_in_same_feed_and_earliest_stop_wins():
    checker = StopChecker(("world", "lo w"))
    assert checker.feed("hello world") == ("hel", True)


def test_overlapping_prefixes_hold_the_longest_candidate():
    checker = StopChecker(("abcd", "bcx"))
    assert checker.feed("zabc") == ("z", False)  # "abc" may become "abcd"
    assert checker.feed("x") == ("a", True)      # ... but "bcx" completed


def test_no_stop_strings_passes_text_through():
    checker = StopChecker()
    assert checker.feed("anything") == ("anything", False)
    assert checker.flush() == ""


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError):
        StopChecker(("",))
