"""What a name to pull means: a Hugging Face repository (safetensors or GGUF) or a model of
Ollama's library. Pure parsing; nothing here touches the network.

Accepted spellings:
  org/repo                       a Hugging Face repository (safetensors, or GGUF at Q4_K_M)
  org/repo:QUANT                 a GGUF repository, the file whose name carries QUANT
  org/repo/file.gguf             one GGUF file of a repository (its split parts with it)
  hf.co/org/repo[:QUANT]         as Ollama spells Hugging Face (huggingface.co/ too)
  llama3.2, qwen3:8b             Ollama's library (namespace "library", default tag "latest")
  ns/name:tag                    another namespace of Ollama's registry; a tag that reads as a
                                 quantisation (Q4_K_M, F16, ...) means Hugging Face instead
  ollama.com/ns/name[:tag]       explicitly Ollama's registry (registry.ollama.ai/ too)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

DEFAULT_QUANT = "Q4_K_M"  # what llama.cpp's -hf picks when no tag is given
DEFAULT_OLLAMA_TAG = "latest"

_HF_PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/", "https://hf.co/")
_OLLAMA_PREFIXES = ("ollama.com/", "registry.ollama.ai/", "https://ollama.com/",
                    "https://registry.ollama.ai/")
# GGUF quantisation names: Q4_K_M, Q8_0, IQ2_XXS, F16, BF16, F32, UD-Q4_K_XL, ...
_QUANT = re.compile(r"^(UD-)?(I?Q\d[\w]*|BF16|F16|F32|FP16)$", re.IGNORECASE)
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO = re.compile(rf"^{_PART}/{_PART}$")
_OLLAMA_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$", re.IGNORECASE)
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


class BadModelName(ValueError):
    """The name is in no form shoal can pull; the message lists the forms it accepts."""


@dataclass(frozen=True)
class HuggingFaceName:
    """A Hugging Face repository; quant or file pick a GGUF (both None: whatever it holds)."""

    repo: str
    quant: str | None = None
    file: str | None = None
    source: Literal["huggingface"] = "huggingface"

    @property
    def key(self) -> str:
        """The store's name for what this pulls (quant resolved later for a bare repo)."""
        if self.file:
            return f"{self.repo}/{self.file}"
        return f"{self.repo}:{self.quant.upper()}" if self.quant else self.repo


@dataclass(frozen=True)
class OllamaName:
    namespace: str
    model: str
    tag: str = DEFAULT_OLLAMA_TAG
    source: Literal["ollama"] = "ollama"

    @property
    def key(self) -> str:
        """As Ollama lists it: llama3.2:latest, or ns/name:tag outside the library."""
        prefix = "" if self.namespace == "library" else f"{self.namespace}/"
        return f"{prefix}{self.model}:{self.tag}"


PullName = HuggingFaceName | OllamaName

_FORMS = ("org/repo, org/repo:QUANT, org/repo/file.gguf, hf.co/org/repo:QUANT, "
          "an Ollama library name such as llama3.2 or qwen3:8b, or ns/name:tag")


def parse_pull_name(name: str) -> PullName:
    """The source and coordinates a name means; BadModelName when it fits no form."""
    text = name.strip() if isinstance(name, str) else ""
    if not text:
        raise BadModelName("model name must not be empty")
    lowered = text.lower()
    for prefix in _HF_PREFIXES:
        if lowered.startswith(prefix):
            return _huggingface(text[len(prefix):], name)
    for prefix in _OLLAMA_PREFIXES:
        if lowered.startswith(prefix):
            return _ollama(text[len(prefix):], name)
    path, _, tag = text.partition(":")
    segments = path.split("/")
    if len(segments) == 1:
        return _ollama(text, name)
    if len(segments) == 2 and tag and not _QUANT.match(tag):
        return _ollama(text, name)
    return _huggingface(text, name)


def _huggingface(text: str, original: str) -> HuggingFaceName:
    path, _, quant = text.partition(":")
    segments = path.split("/")
    if len(segments) >= 3 and path.lower().endswith(".gguf") and not quant:
        repo, file = "/".join(segments[:2]), "/".join(segments[2:])
        if _REPO.match(repo) and ".." not in file.split("/"):
            return HuggingFaceName(repo=repo, file=file)
    if not _REPO.match(path):
        raise BadModelName(f"{original!r} is not a model name shoal can pull; use {_FORMS}")
    if quant and not _TAG.match(quant):
        raise BadModelName(f"{original!r}: {quant!r} is not a quantisation tag "
                           f"(such as {DEFAULT_QUANT})")
    return HuggingFaceName(repo=path, quant=quant or None)


def _ollama(text: str, original: str) -> OllamaName:
    path, _, tag = text.partition(":")
    segments = path.split("/")
    if len(segments) == 1:
        namespace, model = "library", segments[0]
    elif len(segments) == 2:
        namespace, model = segments
    else:
        raise BadModelName(f"{original!r} is not a model name shoal can pull; use {_FORMS}")
    if not (_OLLAMA_NAME.match(namespace) and _OLLAMA_NAME.match(model)):
        raise BadModelName(f"{original!r} is not a model name shoal can pull; use {_FORMS}")
    if tag and not _TAG.match(tag):
        raise BadModelName(f"{original!r}: {tag!r} is not a valid tag")
    return OllamaName(namespace=namespace.lower(), model=model.lower(),
                      tag=tag or DEFAULT_OLLAMA_TAG)
