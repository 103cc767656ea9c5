"""A draft model: a smaller model with the target's tokenizer guesses the next k tokens.

It runs in the target's runner process on a ModelRunner and KV cache of its own (the target
waits for its guesses anyway; another process on the same cores would only add a hop). Per
request it keeps the tokens whose KV it holds; each call cuts that copy back to where it
agrees with the context (rejected guesses go), feeds the new tokens as one chunk, then
decodes k tokens greedily. Greedy guesses are a deterministic function of the context, so
verify.kept_tokens keeps the output exactly the target's, whatever the target samples with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from shoal.engine.config import EngineConfig, ModelSource
from shoal.engine.kv.block_pool import BlockPool
from shoal.engine.model_runner import ModelRunner
from shoal.engine.kv_budget import check_weights_fit
from shoal.engine.models.loader import (
    LoadedModel,
    kv_bytes_per_token,
    load_model,
    read_model_config,
)
from shoal.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from shoal.engine.speculation.proposer import Proposal, common_prefix
from shoal.engine.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# The most tokens fed to the draft in one forward pass (a long prompt is fed in pieces).
CHUNK_TOKENS = 512
# Pieces up to this long (the tokens kept since the last guess) take the generated tokens'
# arithmetic, which reads each weight once for a few rows; longer ones the prompt's. The
# draft's KV only has to guess well, not match the target's bits.
SHORT_PIECE = 4
BLOCK_SIZE = 16  # KV block size of a proposer node's draft model


class DraftMismatch(ValueError):
    """The draft model cannot guess for the target: their tokenizers differ."""


def check_same_tokenizer(target_id: str, target: Tokenizer, draft_id: str,
                         draft: Tokenizer) -> None:
    """Refuse a draft whose token ids mean other text than the target's: its guesses would
    be other words (never wrong output, since the target verifies, but never kept)."""
    target_vocab = target.backend.get_vocab(with_added_tokens=True)
    draft_vocab = draft.backend.get_vocab(with_added_tokens=True)
    if target_vocab == draft_vocab:
        return
    differing = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
    raise DraftMismatch(
        f"draft model {draft_id!r} cannot guess for {target_id!r}: their tokenizers differ "
        f"({len(draft_vocab)} and {len(target_vocab)} tokens, {differing} entries not shared)")


def check_draft_pair(target: ModelSource, draft: ModelSource, cache_dir=None) -> None:
    """check_same_tokenizer on two models' files (at start, before either loads)."""
    check_same_tokenizer(target.model_id, Tokenizer.load(target, cache_dir=cache_dir),
                         draft.model_id, Tokenizer.load(draft, cache_dir=cache_dir))


@dataclass
class _Session:
    tokens: list[int] = field(default_factory=list)  # the tokens whose KV the draft holds
    blocks: list[int] = field(default_factory=list)


class DraftModel:
    """A Proposer (proposer.py) on a local model. vocab_size: the target's; guesses are
    drawn from the ids both models know."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int,
                 vocab_size: int, device: str | torch.device = "cpu") -> None:
        self.loaded = loaded
        self.block_size = block_size
        self.vocab_size = min(vocab_size, loaded.config.vocab_size)
        self.runner = ModelRunner(loaded, num_blocks, block_size, device)
        self.pool = BlockPool(num_blocks, enable_prefix_caching=False)
        self.max_tokens = num_blocks * block_size
        self._sessions: dict[str, _Session] = {}

    @classmethod
    def load(cls, source: ModelSource, dtype: str, device: str, num_blocks: int,
             block_size: int, vocab_size: int) -> DraftModel:
        loaded = load_model(source, dtype, device=device)
        log.info("draft model %s loaded (%.0f MiB)", source.model_id,
                 loaded.weight_bytes / 2**20)
        return cls(loaded, num_blocks, block_size, vocab_size, device)

    @classmethod
    def for_target(cls, config: EngineConfig, target_tokenizer: Tokenizer, num_blocks: int,
                   vocab_size: int) -> DraftModel:
        """The draft model named by the target's --speculative, refused unless it shares
        the target's tokenizer; its KV cache holds as many tokens as the target's (at the
        draft's smaller size per token)."""
        source = config.draft_source
        if source is None:
            raise ValueError(f"speculating with draft model {config.speculative.draft_model!r} "
                             f"needs its files: the node resolves them into draft_source")
        check_weights_fit(source)
        tokenizer = Tokenizer.load(source, cache_dir=config.cache_dir)
        check_same_tokenizer(config.source.model_id, target_tokenizer, source.model_id,
                             tokenizer)
        return cls.load(source, config.dtype, config.device, num_blocks, config.block_size,
                        vocab_size)

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.runner.kv_caches)

    @torch.inference_mode()
    def propose(self, request_id: str, context: Sequence[int], k: int) -> Proposal | None:
        if k < 1 or not context:
            return None
        session = self._sessions.setdefault(request_id, _Session())
        # Keep the shared prefix, less the context's last token: it is fed again, since
        # its logits give the first guess.
        keep = min(common_prefix(session.tokens, context), len(context) - 1)
        k = min(k, self.max_tokens - len(context) + 1)
        if k < 1:
            return None
        self._cut(session, keep)
        # This call writes KV up to the last guess but one: context + k - 1 positions.
        if not self._reserve(session, len(context) + k - 1):
            return None
        logits = self._feed(session, list(context[keep:]), keep)
        tokens: list[int] = []
        probs: list[float] = []
        while True:
            token, prob = self._pick(logits)
            tokens.append(token)
            probs.append(prob)
            if len(tokens) == k:
                break
            logits = self._feed(session, [token], len(context) + len(tokens) - 1)
        session.tokens = list(context) + tokens[:-1]
        return Proposal(tokens, probs)

    def forget(self, request_id: str) -> None:
        session = self._sessions.pop(request_id, None)
        if session is not None:
            self.pool.free(session.blocks)

    # ---- helpers --------------------------------------------------------------------------

    def _cut(self, session: _Session, keep: int) -> None:
        """Hold KV for the first `keep` tokens only (later slots are simply overwritten)."""
        del session.tokens[keep:]
        needed = -(-keep // self.block_size)
        if len(session.blocks) > needed:
            self.pool.free(session.blocks[needed:])
            del session.blocks[needed:]

    def _reserve(self, session: _Session, positions: int) -> bool:
        missing = -(-positions // self.block_size) - len(session.blocks)
        if missing <= 0:
            return True
        if not self.pool.can_allocate(missing):
            return False  # no room now: this step decodes without guesses
        session.blocks.extend(self.pool.allocate(missing))
        return True

    def _feed(self, session: _Session, token_ids: list[int], start: int) -> torch.Tensor:
        """Write KV for token_ids at positions start.. and return the logits after the last
        one: float32 [vocab]."""
        blocks = tuple(session.blocks)
        logits = None
        for offset in range(0, len(token_ids), CHUNK_TOKENS):
            piece = tuple(token_ids[offset:offset + CHUNK_TOKENS])
            last = offset + len(piece) == len(token_ids)
            chunk = ScheduledChunk(request_id="draft", token_ids=piece,
                                   start_position=start + offset, block_ids=blocks,
                                   needs_sample=last, prompt=len(piece) > SHORT_PIECE)
            logits = self.runner.execute(SchedulerOutput(chunks=(chunk,)))
        return logits[0]

    def _pick(self, logits: torch.Tensor) -> tuple[int, float]:
        """The greedy guess and the draft's probability of it."""
        logits = logits[:self.vocab_size].float()
        token = int(torch.argmax(logits))
        prob = float(torch.exp(logits[token] - torch.logsumexp(logits, dim=0)))
        return token, prob


# A proposer node's draft model holds this much KV for all the sessions it guesses for.
SOURCE_KV_BYTES = 256 * 2**20


class DraftSource:
    """A draft model guessing for verifiers on other nodes (--propose-for TARGET=draft:MODEL,
    cluster/proposer_service.py): loaded on the first ask, on the service's worker thread."""

    blocking = True  # its forward passes run off the node's event loop

    def __init__(self, model: str, resolve: Callable[[str], ModelSource]) -> None:
        """resolve: the node's resolver from a model name to its files (catalogue, paths)."""
        if not model:
            raise ValueError("name the draft model, as draft:MODEL")
        self.model = model
        self._resolve = resolve
        self._draft: DraftModel | None = None

    def propose(self, request_id: str, context: Sequence[int], k: int) -> Proposal | None:
        return self._loaded().propose(request_id, context, k)

    def files(self) -> ModelSource:
        """Where the draft model's files are (blocking: may resolve them)."""
        return self._resolve(self.model)

    def forget(self, request_id: str) -> None:
        if self._draft is not None:
            self._draft.forget(request_id)

    def _loaded(self) -> DraftModel:
        if self._draft is None:
            source = self._resolve(self.model)
            config = read_model_config(source)
            per_block = kv_bytes_per_token(config, "auto") * BLOCK_SIZE
            self._draft = DraftModel.load(source, "auto", "cpu",
                                          max(1, SOURCE_KV_BYTES // per_block), BLOCK_SIZE,
                                          config.vocab_size)
        return self._draft
