"""Embedding requests through the supervisor and a runner subprocess (fake engines)."""

from __future__ import annotations

import asyncio

import numpy as np
from fake_embedding import DIMENSIONS, fake_embedding_source, fake_vector
from fakes import fake_engine_config, fake_supervisor_options

from shoal.engine.config import EngineConfig
from shoal.engine.sampling import SamplingParams
from shoal.protocol import EmbeddingRequest, GenerationRequest
from shoal.runner.supervisor import RunnerSupervisor


def run_scenario(config, scenario):
    async def main():
        supervisor = RunnerSupervisor(config, fake_supervisor_options(
            fake_engine="embedding"))
        try:
            await supervisor.start()
            return await scenario(supervisor)
        finally:
            await supervisor.shutdown()

    return asyncio.run(main())


def embed_request(request_id: str, **inputs) -> EmbeddingRequest:
    return EmbeddingRequest(request_id=request_id, model="fake-embed", **inputs)


def test_embedding_runner_answers_batches_and_refuses_bad_inputs(tmp_path):
    config = EngineConfig(source=fake_embedding_source(tmp_path))

    async def scenario(supervisor):
        info = supervisor.model_info
        batch = await supervisor.embed(embed_request("a", texts=("one two", "three")))
        ids = await supervisor.embed(embed_request("b", token_ids=((5, 6, 7),)))
        long_text = "w " * 20
        too_long = await supervisor.embed(embed_request("c", texts=(long_text,)))
        cut = await supervisor.embed(embed_request("d", texts=(long_text,), truncate=True))
        bad_id = await supervisor.embed(embed_request("e", token_ids=((5, 5000),)))
        generate = [c async for c in supervisor.submit(GenerationRequest(
            request_id="f", model="fake-embed", prompt="hi", sampling=SamplingParams()))]
        after = await supervisor.embed(embed_request("g", texts=("still here",)))
        return info, batch, ids, too_long, cut, bad_id, generate, after, supervisor.describe()

    info, batch, ids, too_long, cut, bad_id, generate, after, described = run_scenario(
        config, scenario)
    assert info.task == "embed" and info.embedding_dimensions == DIMENSIONS
    assert batch.kind == "embedding" and batch.prompt_tokens == 4 + 3
    assert len(batch.embeddings) == 2 and batch.embeddings[0][0] != batch.embeddings[1][0]
    expected = np.asarray(fake_vector([5, 6, 7]), dtype=np.float32)  # float32 on the wire
    assert ids.embeddings[0] == tuple(float(v) for v in expected)
    assert too_long.kind == "error" and too_long.code == "context_length_exceeded"
    assert too_long.param == "input" and "22 tokens" in too_long.message
    assert cut.kind == "embedding" and cut.prompt_tokens == 16
    assert bad_id.code == "invalid_request" and bad_id.param == "input"
    assert [c.kind for c in generate] == ["error"]
    assert generate[0].code == "invalid_request" and generate[0].param == "model"
    assert "embedding model" in generate[0].message
    assert after.kind == "embedding"
    # What it holds: its resident memory (the weights' 1234 bytes among it; no KV grant).
    assert described["task"] == "embed" and described["size_bytes"] > 1234


def test_text_runner_refuses_embedding_requests(tmp_path):
    async def scenario(supervisor):
        return (await supervisor.embed(embed_request("a", texts=("hi",))),
                supervisor.model_info.task)

    refused, task = run_scenario(fake_engine_config(tmp_path), scenario)
    assert task == "generate"
    assert refused.kind == "error" and refused.code == "invalid_request"
    assert refused.param == "model" and "does not produce embeddings" in refused.message
