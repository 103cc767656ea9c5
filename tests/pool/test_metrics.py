"""A node's metrics move with its traffic: tokens, first-token and inter-token times, the
queue, loads and evictions, runner KV memory and the cluster, read back with
prometheus-client's own parser."""

from __future__ import annotations

import asyncio

from memory_pool import generate, make_router, shutdown
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families


def samples(router) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(router.metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(table, name: str, **labels) -> float:
    return table.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_follow_requests_loads_and_evictions(sources):
    async def main():
        router = await make_router(sources, [], max_loaded_models=1)
        before = samples(router)
        chunks = [c async for c in router.submit(generate("chat", "tokens:3:0.01"))]
        during = asyncio.create_task(_drain(router.submit(generate("chat", "hold:0.3"))))
        await asyncio.sleep(0.1)
        busy = samples(router)
        await during
        # A second model under a one-model limit evicts the idle first.
        [c async for c in router.submit(generate("other", "tokens:1:0"))]
        after = samples(router)
        await shutdown(router)
        return chunks, before, busy, after

    chunks, before, busy, after = asyncio.run(main())
    assert chunks[-1].kind == "finish"
    assert value(before, "shoal_generated_tokens_total", model="chat") == 0
    assert value(after, "shoal_generated_tokens_total", model="chat") == 3
    assert value(after, "shoal_prompt_tokens_total", model="chat") == 2  # 1 per request
    assert value(after, "shoal_time_to_first_token_seconds_count", model="chat") == 1
    assert value(after, "shoal_inter_token_latency_seconds_count", model="chat") == 2
    assert value(after, "shoal_inter_token_latency_seconds_sum", model="chat") >= 0.015
    assert value(busy, "shoal_queue_running", model="chat") == 1
    assert value(after, "shoal_model_loads_total", model="chat") == 1
    assert value(after, "shoal_model_loads_total", model="other") == 1
    assert value(after, "shoal_model_evictions_total", model="chat") == 1
    assert value(after, "shoal_cluster_nodes") == 1
    assert value(after, "shoal_cluster_events_applied_total") > \
        value(before, "shoal_cluster_events_applied_total")
    assert value(after, "shoal_cluster_master_changes_total") == 0
    assert ("shoal_cluster_outbox_messages", ()) in after
    assert value(after, "shoal_cluster_messages_unsent_total", reason="dropped") == 0


async def _drain(stream) -> None:
    async for _ in stream:
        pass
