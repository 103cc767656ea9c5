"""The engine's tokenizer: a `tokenizers.Tokenizer` plus special ids and the chat template.

Loads from a GGUF (built from its metadata once, then cached as tokenizer.json under cache_dir)
or from a Hugging Face style directory (tokenizer.json + tokenizer_config.json).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from shoal.engine.config import ModelSource
from shoal.engine.errors import UnsupportedModel
from shoal.engine.tokenizer.chat_template import ChatTemplate, default_template
from shoal.engine.tokenizer.gguf_vocab import (
    TokenizerInfo,
    build_tokenizer,
    byte_alphabet_inverse,
    tokenizer_info,
)
from shoal.engine.weights.gguf_file import read_gguf_metadata

_CACHE_FORMAT = 1  # bump when the built tokenizer.json would change for the same file
# A vocabulary with all of these speaks OpenAI's harmony chat format (gpt-oss).
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                  "<|call|>", "<|constrain|>")


def default_cache_dir() -> Path:
    """Where built tokenizers are cached when the caller gives no directory."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shoal" / "tokenizers"


class Tokenizer:
    """Encode/decode, special token ids and chat rendering for one model."""

    def __init__(self, backend: BackendTokenizer, info: TokenizerInfo,
                 special_tokens: Mapping[str, str | None] | None = None) -> None:
        self.backend = backend
        self.architecture = info.architecture
        self.bos_token_id = info.bos_token_id
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.add_bos = info.add_bos
        self.has_chat_template = bool(info.chat_template)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        tokens = dict(special_tokens or {})
        primary_eos = info.eos_token_ids[0] if info.eos_token_ids else None
        tokens["bos_token"] = tokens.get("bos_token") or self._id_text(info.bos_token_id)
        tokens["eos_token"] = tokens.get("eos_token") or self._id_text(primary_eos)
        self._special_tokens = tokens  # bos_token/eos_token/... as templates expect them
        self._chat_source = info.chat_template or default_template(info.architecture)
        self._chat_template: ChatTemplate | None = None  # compiled on first use
        self._byte_level, self._byte_fallback = _decoder_style(backend)
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self._added_ids = {token.content: index for index, token in added.items()}
        self.special_token_ids = frozenset(i for i, token in added.items() if token.special)
        self.speaks_harmony = all(token in self._added_ids for token in HARMONY_TOKENS)
        if self.speaks_harmony:
            # A harmony reply ends with <|return|> (answered) or <|call|> (a tool call);
            # <|end|> only closes one message of several (the reasoning before the answer).
            ids = self._added_ids
            self.eos_token_ids = (self.eos_token_ids - {ids["<|end|>"]}) | {
                ids["<|return|>"], ids["<|call|>"]}

    @classmethod
    def load(cls, source: ModelSource, cache_dir: Path | None = None) -> Tokenizer:
        """The tokenizer for a resolved model (a .gguf file or a HF-style directory)."""
        if source.format == "gguf":
            return _load_gguf(source.path, cache_dir or default_cache_dir())
        return _load_hf_directory(source.path)

    # -- encoding -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text. Special tokens written in the text (e.g. <|im_start|>) are kept whole.

        With add_special_tokens the model's BOS is added, but never doubled: a text that already
        starts with the BOS token (a rendered chat template) keeps just that one.
        """
        if not isinstance(text, str):
            raise ValueError("text to encode must be a string")
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos and len(ids) >= 2
                and ids[0] == ids[1] == self.bos_token_id):
            del ids[0]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The token's own text (for logprobs): its bytes as UTF-8, U+FFFD for partial bytes."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token contributes to the output text."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary ({self.vocab_size})")
        if piece in self._added_ids:
            return piece.encode("utf-8")
        if self._byte_level:
            return _byte_level_bytes(piece)
        if self._byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece[-1] == ">":
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    # -- chat -----------------------------------------------------------------------------

    @property
    def chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            self._chat_template = ChatTemplate(self._chat_source, self._special_tokens)
        return self._chat_template

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            variables: Mapping[str, Any] | None = None) -> str:
        """The prompt text for a conversation; encode it with encode(text)."""
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **(variables or {}))

    def _id_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)


def _decoder_style(backend: BackendTokenizer) -> tuple[bool, bool]:
    """(byte-level, byte-fallback) from the decoder's serialized form."""
    decoder = backend.decoder
    state = decoder.__getstate__().decode("utf-8", errors="replace") if decoder else ""
    return '"ByteLevel"' in state, '"ByteFallback"' in state


def _byte_level_bytes(piece: str) -> bytes:
    decode_map = byte_alphabet_inverse()
    try:
        return bytes(decode_map[char] for char in piece)
    except KeyError:
        return piece.encode("utf-8")


# -- GGUF ---------------------------------------------------------------------------------


def _load_gguf(path: Path, cache_dir: Path) -> Tokenizer:
    entry = cache_dir / _cache_key(path)
    tokenizer_file, info_file = entry / "tokenizer.json", entry / "shoal-tokenizer.json"
    if tokenizer_file.exists() and info_file.exists():
        try:
            info = TokenizerInfo.from_json(json.loads(info_file.read_text()))
            return Tokenizer(BackendTokenizer.from_file(str(tokenizer_file)), info)
        except Exception:  # noqa: BLE001 - any unreadable cache entry is rebuilt, not fatal
            pass
    metadata = read_gguf_metadata(path)
    backend, info = build_tokenizer(metadata), tokenizer_info(metadata)
    _write_cache(entry, backend, info)
    return Tokenizer(backend, info)


def _cache_key(path: Path) -> str:
    """A directory name that changes whenever the file (or the cache format) does."""
    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_CACHE_FORMAT}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return f"{path.stem}-{digest}"


def _write_cache(entry: Path, backend: BackendTokenizer, info: TokenizerInfo) -> None:
    # Write to temporary names and rename, so a concurrent reader never sees half a file.
    try:
        entry.mkdir(parents=True, exist_ok=True)
        suffix = f".tmp{os.getpid()}"
        tokenizer_tmp = entry / f"tokenizer.json{suffix}"
        info_tmp = entry / f"shoal-tokenizer.json{suffix}"
        backend.save(str(tokenizer_tmp))
        info_tmp.write_text(json.dumps(info.to_json()))
        os.replace(tokenizer_tmp, entry / "tokenizer.json")
        os.replace(info_tmp, entry / "shoal-tokenizer.json")
    except OSError:
        pass  # a read-only cache only costs speed


# -- Hugging Face directory ---------------------------------------------------------------


def _load_hf_directory(directory: Path) -> Tokenizer:
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.exists():
        raise UnsupportedModel(f"{directory} has no tokenizer.json")
    backend = BackendTokenizer.from_file(str(tokenizer_file))
    # Some tokenizer.json files (MiniLM) enable padding/truncation; the engine wants neither.
    backend.no_padding()
    backend.no_truncation()
    config = _read_json(directory / "tokenizer_config.json")
    model_config = _read_json(directory / "config.json")
    generation = _read_json(directory / "generation_config.json")
    bos_text = _token_content(config.get("bos_token"))
    eos_text = _token_content(config.get("eos_token"))
    bos_id = backend.token_to_id(bos_text) if bos_text else None
    if bos_id is None:
        bos_id = _first_int(model_config.get("bos_token_id"))
    eos_ids: list[int] = []
    for candidate in (generation.get("eos_token_id"), model_config.get("eos_token_id")):
        eos_ids += [i for i in _int_list(candidate) if i not in eos_ids]
    if eos_text and backend.token_to_id(eos_text) is not None:
        eos_id = backend.token_to_id(eos_text)
        eos_ids = [eos_id] + [i for i in eos_ids if i != eos_id]
    probe = backend.encode("a", add_special_tokens=True).ids
    info = TokenizerInfo(
        architecture=str(model_config.get("model_type", "")),
        bos_token_id=bos_id, eos_token_ids=tuple(eos_ids),
        add_bos=bos_id is not None and bool(probe) and probe[0] == bos_id,
        chat_template=_chat_template_source(directory, config))
    special = {"bos_token": bos_text, "eos_token": eos_text,
               "unk_token": _token_content(config.get("unk_token")),
               "pad_token": _token_content(config.get("pad_token"))}
    return Tokenizer(backend, info, special)


def _chat_template_source(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template.strip() else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _token_content(token: Any) -> str | None:
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def _int_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _first_int(value: Any) -> int | None:
    values = _int_list(value)
    return values[0] if values else None
