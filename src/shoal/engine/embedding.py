"""The embedding engine: texts or token ids -> one float32 vector per input.

Synchronous like the generation engine, but with no scheduler or KV cache: a batch of inputs
is sorted by length, cut into padded sub-batches within a token budget, encoded in one
forward each, pooled and (per the model's config) L2-normalised.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer as BackendTokenizer

from shoal.engine.config import EngineConfig
from shoal.engine.core import EngineTask, NoGeneration, NotFollower, ProgressCallback
from shoal.engine.errors import ContextLengthExceeded, UnsupportedModel
from shoal.engine.kv_budget import check_weights_fit
from shoal.engine.models.registry import encoder_loader, family_of, hf_architecture_name
from shoal.engine.pooling import pool, read_pooling_config
from shoal.engine.sampling import InvalidParameter
from shoal.engine.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EmbeddingEngine(NoGeneration, NotFollower):
    """One encoder model serving embedding requests, one batch at a time."""

    task: EngineTask = "embed"
    tracer = None  # a batch is answered at once: no request spans

    def __init__(self, config: EngineConfig, progress: ProgressCallback | None = None) -> None:
        report = progress or (lambda _stage, _fraction: None)
        self.config = config
        source = config.source
        if source.format != "safetensors":
            raise UnsupportedModel(f"model {source.model_id!r}: embedding models load from a "
                                   f"safetensors directory, not {source.format}")
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        check_weights_fit(source)
        report("tokenizer", 0.0)
        self.tokenizer = Tokenizer.load(source, cache_dir=config.cache_dir)
        hf = json.loads((Path(source.path) / "config.json").read_text())
        family = family_of(hf_architecture_name(hf))
        self.pooling = read_pooling_config(source.path)
        # auto means float32 here: encoders are small and embeddings are judged by exactness.
        dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
        self.model = encoder_loader(family)(source.path, dtype, config.device,
                                            progress=lambda f: report("weights", f))
        model_config = self.model.config
        self.device = config.device
        self.model_id = source.model_id
        self.vocab_size = model_config.vocab_size
        self.dimensions = model_config.hidden_size
        self.max_model_len = _context_length(model_config.max_position,
                                             self.pooling.max_seq_length, config.max_model_len)
        # Padded tokens per forward; one longest input always fits.
        self.max_batch_tokens = max(config.max_num_batched_tokens, self.max_model_len)
        self._truncating = BackendTokenizer.from_str(self.tokenizer.backend.to_str())
        self._truncating.enable_truncation(self.max_model_len)
        report("ready", 1.0)
        log.info("embedding engine ready: %s, %d dimensions, context %d, pooling %s%s",
                 self.model_id, self.dimensions, self.max_model_len, self.pooling.mode,
                 ", normalised" if self.pooling.normalize else "")

    def weight_bytes(self) -> int:
        return self.model.weight_bytes()

    def kv_bytes_per_block(self) -> None:
        return None  # an encoder keeps no KV cache

    def close(self) -> None:
        pass  # nothing outlives the process

    # ---- inputs ---------------------------------------------------------------------------

    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        """Token ids of each text (with the model's [CLS] / [SEP]); with truncate, cut to the
        context keeping the closing special token, else ContextLengthExceeded."""
        backend = self._truncating if truncate else self.tokenizer.backend
        ids = [encoding.ids for encoding in backend.encode_batch(list(texts),
                                                                 add_special_tokens=True)]
        self._check_lengths(ids)
        return ids

    def check_token_ids(self, inputs: Sequence[Sequence[int]], truncate: bool) -> list[list[int]]:
        """Token-id inputs as given (no special tokens added), checked against the vocabulary
        and the context; with truncate, cut to the context."""
        checked = []
        for index, ids in enumerate(inputs):
            ids = list(ids)
            if not ids:
                raise InvalidParameter("input", f"input {index} has no tokens")
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidParameter("input", f"token id {bad} in input {index} is outside "
                                                f"the vocabulary (size {self.vocab_size})")
            checked.append(ids[:self.max_model_len] if truncate else ids)
        self._check_lengths(checked)
        return checked

    def _check_lengths(self, inputs: list[list[int]]) -> None:
        for index, ids in enumerate(inputs):
            if len(ids) > self.max_model_len:
                raise ContextLengthExceeded(
                    f"input {index} has {len(ids)} tokens; this model's maximum context "
                    f"length is {self.max_model_len} tokens")

    # ---- the forward ----------------------------------------------------------------------

    def embed(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """[B, dimensions] float32 vectors for B token-id lists, in input order."""
        out = torch.empty(len(inputs), self.dimensions, dtype=torch.float32)
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        with torch.inference_mode():
            for batch in self._batches(order, inputs):
                out[batch] = self._embed_padded([inputs[i] for i in batch]).cpu()
        return out

    def _batches(self, order: list[int], inputs: Sequence[Sequence[int]]) -> list[list[int]]:
        """Cut indices (sorted by length) so each batch's padded size fits the budget."""
        batches: list[list[int]] = []
        for index in order:
            current = batches[-1] if batches else None
            # sorted ascending, so this input is the longest of its batch
            if current is None or (len(current) + 1) * len(inputs[index]) > self.max_batch_tokens:
                batches.append([index])
            else:
                current.append(index)
        return batches

    def _embed_padded(self, rows: list[Sequence[int]]) -> torch.Tensor:
        length = max(len(ids) for ids in rows)
        input_ids = torch.zeros(len(rows), length, dtype=torch.long)  # [b, T]; pad id 0
        mask = torch.zeros(len(rows), length, dtype=torch.bool)       # [b, T]; True = real
        for row, ids in enumerate(rows):
            input_ids[row, :len(ids)] = torch.tensor(list(ids), dtype=torch.long)
            mask[row, :len(ids)] = True
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids, mask)  # [b, T, H]
        return pool(hidden, mask, self.pooling)  # [b, H] float32


def _context_length(max_position: int, trained_length: int | None,
                    configured: int | None) -> int:
    """Longest input: the trained length when the checkpoint names one (inputs past it
    embed poorly), never past the position table, nor past --max-model-len."""
    limit = min(max_position, trained_length or max_position)
    return min(limit, configured) if configured is not None else limit
