"""How a model speculates (the value of --speculative): `ngram[:K]` guesses from the
request's own text, `draft:MODEL[:K]` from a smaller model, `remote[:K]` asks a proposer
on another node of the cluster (one whose capability card offers this model as a target,
shoal serve --propose-for MODEL)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Method = Literal["ngram", "draft", "remote"]
# Per-request choices (the x_speculative extension field); None follows the model.
REQUEST_CHOICES = ("off", "ngram", "draft")
DEFAULT_NUM_DRAFTS = 10
MAX_NUM_DRAFTS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: where guesses come from; num_drafts: the most tokens guessed per step;
    draft_model: the smaller model (same tokenizer) that guesses, for method "draft";
    "remote": a proposer node guesses (engine/speculation/remote.py)."""

    method: Method
    num_drafts: int = DEFAULT_NUM_DRAFTS
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft", "remote"):
            raise ValueError(f"speculation method must be ngram, draft or remote, not "
                             f"{self.method!r}")
        if not 1 <= self.num_drafts <= MAX_NUM_DRAFTS:
            raise ValueError(f"the number of guessed tokens must be in 1..{MAX_NUM_DRAFTS}, "
                             f"not {self.num_drafts}")
        if (self.method == "draft") != bool(self.draft_model):
            raise ValueError("a draft model is named with draft:MODEL, and only there")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """'ngram', 'ngram:4', 'draft:qwen2.5-coder-0.5b-instruct', 'draft:MODEL:4',
        'remote' or 'remote:4'."""
        method, _, rest = text.strip().partition(":")
        num_drafts = DEFAULT_NUM_DRAFTS
        if method in ("ngram", "remote"):
            if rest:
                num_drafts = _count(rest, text)
            return cls(method, num_drafts)
        if method == "draft":
            model, _, count = rest.rpartition(":") if _ends_in_count(rest) else (rest, "", "")
            if count:
                num_drafts = _count(count, text)
            if not model:
                raise ValueError(f"{text!r}: name the draft model, as draft:MODEL[:K]")
            return cls("draft", num_drafts, model)
        raise ValueError(f"{text!r}: speculation is ngram[:K], draft:MODEL[:K] or remote[:K]")


def parse_assignment(text: str) -> tuple[str, SpeculativeConfig]:
    """'MODEL=ngram:4' -> ('MODEL', SpeculativeConfig('ngram', 4))."""
    model, sep, value = text.partition("=")
    if not sep or not model.strip():
        raise ValueError(f"{text!r}: --speculative takes MODEL=ngram[:K], "
                         f"MODEL=draft:DRAFT_MODEL[:K] or MODEL=remote[:K]")
    return model.strip(), SpeculativeConfig.parse(value)


def _ends_in_count(rest: str) -> bool:
    _, sep, tail = rest.rpartition(":")
    return bool(sep) and tail.isdigit()


def _count(value: str, text: str) -> int:
    if not value.isdigit():
        raise ValueError(f"{text!r}: K must be a whole number of tokens, not {value!r}")
    return int(value)
