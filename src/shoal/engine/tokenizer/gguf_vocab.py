"""Build a `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata (tokenizer.ggml.*).

Two vocabulary styles are supported:
  - "gpt2": byte-level BPE with explicit merges (SmolLM2, Llama 3, Qwen 2); the text is split by
    the pre-tokenizer regexes named by tokenizer.ggml.pre, as llama.cpp does.
  - "llama": SentencePiece-style BPE with scores and byte fallback (Llama 2, Gemma). The file has
    no merges; they are recovered from the vocabulary: every token that splits into two other
    tokens gives a merge, ranked by the token's score (or, for families declared with Gemma's
    sentencepiece_style, by its position, which is the order SentencePiece learned them in).
Control tokens become special added tokens, user-defined ones plain added tokens, so neither is
ever cut into pieces.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.registry import find_family

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_SPIECE_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# Pre-tokenizer split patterns by tokenizer.ggml.pre, each applied in turn (as llama.cpp does).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_THEN_GPT2 = (r"\p{N}", _GPT2_SPLIT)
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    "smollm": _DIGIT_THEN_GPT2,
    "starcoder": _DIGIT_THEN_GPT2,
    "refact": _DIGIT_THEN_GPT2,
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}


class UnsupportedTokenizer(UnsupportedModel):
    """The GGUF describes a tokenizer style shoal cannot build."""


@dataclass(frozen=True)
class TokenizerInfo:
    """What the Tokenizer facade needs besides the `tokenizers.Tokenizer` itself."""

    architecture: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool
    chat_template: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture, "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids), "add_bos": self.add_bos,
            "chat_template": self.chat_template,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TokenizerInfo:
        return cls(data["architecture"], data["bos_token_id"], tuple(data["eos_token_ids"]),
                   bool(data["add_bos"]), data["chat_template"])


def tokenizer_info(metadata: dict[str, Any]) -> TokenizerInfo:
    """Special ids, BOS policy and chat template from GGUF metadata."""
    model_type = metadata.get("tokenizer.ggml.model")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    eos_ids = [eos] if eos is not None else []
    # End-of-turn tokens also end generation (Gemma's <end_of_turn>, ChatML's <|im_end|>).
    eot = metadata.get("tokenizer.ggml.eot_token_id")
    if eot is not None and eot not in eos_ids:
        eos_ids.append(eot)
    tokens = metadata.get("tokenizer.ggml.tokens", [])
    token_ids = {token: index for index, token in enumerate(tokens)}
    for marker in ("<end_of_turn>", "<|im_end|>", "<|eot_id|>"):
        if marker in token_ids and token_ids[marker] not in eos_ids:
            eos_ids.append(token_ids[marker])
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", model_type == "llama"))
    return TokenizerInfo(
        architecture=str(metadata.get("general.architecture", "")),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(eos_ids),
        add_bos=add_bos,
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the one the GGUF metadata describes."""
    model_type = metadata.get("tokenizer.ggml.model")
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise UnsupportedTokenizer("the GGUF file has no tokenizer.ggml.tokens")
    architecture = str(metadata.get("general.architecture", ""))
    if model_type == "gpt2":
        tokenizer, vocab = _byte_level_bpe(metadata, tokens)
    elif model_type == "llama":
        tokenizer, vocab = _sentencepiece_bpe(metadata, tokens, architecture)
    else:
        raise UnsupportedTokenizer(
            f"GGUF tokenizer model {model_type!r} is not supported (supported: gpt2, llama)")
    _add_special_tokens(tokenizer, metadata, tokens, vocab, byte_level=model_type == "gpt2")
    info = tokenizer_info(metadata)
    if info.add_bos and info.bos_token_id is not None:
        bos = tokens[info.bos_token_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
            special_tokens=[(bos, info.bos_token_id)])
    return tokenizer


def _byte_level_bpe(metadata: dict[str, Any], tokens: list[str]) -> tuple[Tokenizer, dict]:
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    # llama.cpp stores byte-level tokens already in the printable-byte alphabet; respell any that
    # are not (rare), so the vocabulary and the pre-tokenizer agree.
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= spelled:
            token = "".join(alphabet[byte] for byte in token.encode("utf-8"))
        vocab[token] = index
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges") or []]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                     byte_fallback=False))
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    splits = PRE_TOKENIZER_SPLITS.get(pre, PRE_TOKENIZER_SPLITS["default"])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, vocab


def _sentencepiece_bpe(metadata: dict[str, Any], tokens: list[str],
                       architecture: str) -> tuple[Tokenizer, dict]:
    family = find_family(architecture)
    gemma = family is not None and family.sentencepiece_style == "gemma"
    if gemma:
        # Gemma files store tokens of two or more spaces as real spaces; the model looks them up
        # as "▁▁", so respell them before deriving merges.
        tokens = [_SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    if gemma:
        # Gemma's scores do not follow its merge order; the position in the file does.
        priority = {token: -index for token, index in vocab.items()}
    else:
        scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        priority = {token: scores[index] for token, index in vocab.items()}
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=derive_merges(vocab, priority),
                                     unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tokenizer.normalizer = normalizers.Replace(" ", _SPIECE_SPACE)
    else:
        add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPIECE_SPACE, prepend_scheme="first" if add_prefix else "never",
            split=False)
        if add_prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer, vocab


def derive_merges(vocab: dict[str, int],
                  priority: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary: (left, right) for each token that splits into two tokens.

    Ranked best first by the merged token's priority (higher first); within one token, longer left
    pieces first. This reproduces transformers' ordering for the same vocabulary.
    """
    ranked: list[tuple[float, int, str, str]] = []
    for token, score in priority.items():
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((score, cut, left, right))
    # Ties in priority go to the longer left piece, then first-seen (the sort is stable).
    ranked.sort(key=lambda item: (item[0], item[1], len(item[3])), reverse=True)
    return [(left, right) for _, _, left, right in ranked]


def _add_special_tokens(tokenizer: Tokenizer, metadata: dict[str, Any], tokens: Sequence[str],
                        vocab: dict[str, int], byte_level: bool) -> None:
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelled = set(byte_alphabet().values()) if byte_level else None
    named_ids = [metadata.get(f"tokenizer.ggml.{name}_token_id")
                 for name in ("bos", "eos", "unknown", "padding")]
    special = {index for index in named_ids if index is not None and index < len(tokens)}
    special.update(index for index, kind in enumerate(types) if kind == TOKEN_TYPE_CONTROL)
    # A byte-level "control" token outside the byte alphabet is a llama.cpp mislabel; adding it
    # would grow the vocabulary past the model's size.
    tokenizer.add_special_tokens([
        AddedToken(tokens[index], normalized=False, special=True)
        for index in sorted(special)
        if spelled is None or set(tokens[index]) <= spelled])
    user_defined = _user_defined(tokens, types, vocab)
    if user_defined:
        tokenizer.add_tokens(user_defined)


def _user_defined(tokens: Sequence[str], types: Iterable[int],
                  vocab: dict[str, int]) -> list[AddedToken]:
    # llama.cpp always matches user-defined tokens (Gemma's "\n\n", "<table>") whole.
    return [AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, types)
            if kind == TOKEN_TYPE_USER_DEFINED and token in vocab]


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


@lru_cache(maxsize=1)
def byte_alphabet_inverse() -> dict[str, int]:
    """Printable character -> byte, the inverse of byte_alphabet()."""
    return {char: byte for byte, char in byte_alphabet().items()}
