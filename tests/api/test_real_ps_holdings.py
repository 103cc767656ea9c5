"""What /api/ps says a model holds is what its runner really holds, and its KV capacity does
not depend on what loaded before it (real runners of the built-in SmolLM2 and all-MiniLM)."""

from __future__ import annotations

import asyncio

import httpx
import psutil
import pytest
from fakes import ScriptedRouter

from shoal.api.app import create_app
from shoal.catalog.resolve import resolve_model
from shoal.cluster.model_facts import model_facts_from_source
from shoal.cluster.placement import shard_bytes
from shoal.engine.config import EngineConfig
from shoal.runner.memory import private_resident_bytes
from shoal.runner.supervisor import RunnerSupervisor

pytestmark = pytest.mark.slow

CHAT, EMBEDDER = "smollm2", "all-minilm-l6-v2"


async def started(name: str) -> RunnerSupervisor:
    supervisor = RunnerSupervisor(EngineConfig(source=resolve_model(name), threads=1))
    await supervisor.start()
    return supervisor


def estimate(name: str) -> int:
    facts = model_facts_from_source(resolve_model(name))
    return shard_bytes(facts, facts.n_layers)


def test_ps_reports_real_holdings_and_kv_capacity_ignores_load_order():
    async def main():
        alone = await started(CHAT)
        first = (alone.memory.kv_bytes_capacity, alone.model_info.max_model_len)
        await alone.shutdown()
        runners = [await started(EMBEDDER)]
        try:
            runners.append(await started(CHAT))  # now with another model loaded first
            after = (runners[1].memory.kv_bytes_capacity, runners[1].model_info.max_model_len)
            router = ScriptedRouter()
            router.supervisors = runners
            transport = httpx.ASGITransport(create_app(router, list_available=list))
            async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
                models = (await client.get("/api/ps")).json()["models"]
            rss = {s.model_id: psutil.Process(s.pid).memory_info().rss for s in runners}
            private = {s.model_id: private_resident_bytes(s.pid) for s in runners}
        finally:
            for runner in runners:
                await runner.shutdown()
        return first, after, {m["model"]: m["size"] for m in models}, rss, private

    first, after, sizes, rss, private = asyncio.run(main())
    assert first == after and first[1] == 8192  # the same pool, the model's whole context
    assert set(sizes) == {"smollm2-135m-instruct", "all-minilm-l6-v2"}
    for model, size in sizes.items():
        # At least what the runner holds on its own, at most twice its whole RSS (which
        # also counts torch's shared library pages).
        assert 0.9 * private[model] <= size <= 2 * rss[model], (model, size, rss[model])
    # Placement's estimate before a first load is within 15% of what the model then holds.
    for name, model in ((CHAT, "smollm2-135m-instruct"), (EMBEDDER, "all-minilm-l6-v2")):
        assert abs(estimate(name) - sizes[model]) <= 0.15 * sizes[model], (model, sizes)
