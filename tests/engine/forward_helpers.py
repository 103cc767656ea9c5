"""Drive ModelRunner directly with hand-built scheduler outputs (no scheduler needed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shoal.engine.config import ModelSource
from shoal.engine.model_runner import ModelRunner
from shoal.engine.models.loader import load_model
from shoal.engine.scheduler_output import ScheduledChunk, SchedulerOutput


def chunk(request_id: str, token_ids, start: int, blocks, sample: bool = True,
          prompt: bool | None = None) -> ScheduledChunk:
    """A chunk; by default more than one token means prompt tokens, one a generated token."""
    return ScheduledChunk(request_id=request_id, token_ids=tuple(token_ids),
                          start_position=start, block_ids=tuple(blocks), needs_sample=sample,
                          prompt=len(token_ids) > 1 if prompt is None else prompt)


def step(runner: ModelRunner, *chunks: ScheduledChunk) -> torch.Tensor:
    return runner.execute(SchedulerOutput(chunks=tuple(chunks)))


def all_position_logits(runner: ModelRunner, token_ids: list[int], blocks) -> torch.Tensor:
    """Logits [T, vocab] for every prompt position (one prefill, every row asked for: the
    last layer otherwise goes on with the sampled rows alone)."""
    output = SchedulerOutput(chunks=(chunk("all", token_ids, 0, blocks),))
    with torch.inference_mode():
        part = runner.prepare(output).parts[0]
        meta = dataclasses.replace(part.meta, logits_indices=torch.arange(len(token_ids)),
                                   logits_prompt_from=part.meta.prompt_from)
        hidden = runner.model(part.token_ids, meta, runner.kv_caches)
        return runner.model.compute_logits(hidden, meta.prompt_from)


def greedy(runner: ModelRunner, prompt: list[int], steps: int, blocks) -> list[int]:
    """Greedy tokens: one prefill, then one decode step per token."""
    logits = step(runner, chunk("greedy", prompt, 0, blocks))
    ids = list(prompt)
    out = []
    for _ in range(steps):
        token = int(logits[0].argmax())
        out.append(token)
        ids.append(token)
        logits = step(runner, chunk("greedy", [token], len(ids) - 1, blocks))
    return out


def greedy_batch(runner: ModelRunner, prompts: list[list[int]], steps: int,
                 blocks_per_request: int) -> list[list[int]]:
    """Greedy tokens of several prompts: one prefill each, then batched decode steps."""
    tables = [list(range(i * blocks_per_request, (i + 1) * blocks_per_request))
              for i in range(len(prompts))]
    logits = step(runner, *(chunk(str(i), p, 0, tables[i]) for i, p in enumerate(prompts)))
    lengths = [len(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        tokens = [int(row.argmax()) for row in logits]
        for out, token in zip(outputs, tokens):
            out.append(token)
        logits = step(runner, *(chunk(str(i), [t], lengths[i], tables[i])
                                for i, t in enumerate(tokens)))
        lengths = [n + 1 for n in lengths]
    return outputs


def load_checkpoint(checkpoint, fmt: str, dtype: str = "float32"):
    """A tiny_models checkpoint loaded from its safetensors or its GGUF."""
    path = checkpoint.gguf_path if fmt == "gguf" else checkpoint.safetensors_dir
    return load_model(ModelSource(checkpoint.family, fmt, path), dtype)


def load_packed(checkpoint):
    """The checkpoint's GGUF in bf16 with weights kept packed (skipped where no packed-weight
    kernel runs on this CPU)."""
    loaded = load_checkpoint(checkpoint, "gguf", "bfloat16")
    if not loaded.module.plan.backend.packs_weights:
        pytest.skip("no packed-weight kernel on this CPU")
    return loaded


def loaded_greedy(loaded, prompts: list[list[int]], steps: int, block: int = 4,
                  blocks_per_request: int = 16) -> list[list[int]]:
    """Greedy tokens of prompts through a fresh ModelRunner over a loaded model."""
    runner = ModelRunner(loaded, blocks_per_request * len(prompts), block)
    return greedy_batch(runner, prompts, steps, blocks_per_request)
