"""The model pool through the router, on a standalone node (a cluster of one): every model
an instance placed on first use, one placement for concurrent first requests, task checks,
keep-alive ending the instance, and instances placed through the cluster; over in-memory
supervisors (no subprocesses; keep-alive times of tens of milliseconds)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from memory_pool import (
    LOAD_S,
    embed,
    generate,
    loaded,
    make_router,
    run,
    shutdown,
)

from shoal.cluster.instances import PlacementRequest
from shoal.cluster.model_facts import model_facts_from_source

sys.path.insert(0, str(Path(__file__).parents[1] / "cluster"))
from cluster_waits import wait_until  # noqa: E402


def models_of(router) -> list[str]:
    return sorted(i.model for i in router.cluster.state.instances.values())


def test_models_load_on_first_use_and_concurrent_first_requests_share_one_load(sources):
    events = []

    async def main():
        router = await make_router(sources, events)
        assert router.supervisors == []
        results = await asyncio.gather(*(router.embed(embed("embedder")) for _ in range(4)))
        state = loaded(router), router.supervisors[0].expires_at, models_of(router)
        instance = next(iter(router.cluster.state.instances.values()))
        await shutdown(router)
        return results, state, instance

    results, (names, expires_at, instances), instance = asyncio.run(main())
    assert events.count(("start", "embedder")) == 1
    assert all(r.kind == "embedding" and r.embeddings == ((1.0, 0.0),) for r in results)
    assert max(r.load_duration_s for r in results) >= LOAD_S * 0.9
    assert names == ["embedder"] and expires_at is not None  # default keep-alive: 300 s
    # The model runs as an instance of the cluster state, placed for requests.
    assert instances == ["embedder"] and instance.request.on_demand
    assert instance.request.keep_alive_s == 300.0


def test_idle_models_unload_after_keep_alive_and_reload_on_next_use(sources):
    events = []

    async def main():
        router = await make_router(sources, events, keep_alive_s=0.1)
        await router.embed(embed("embedder"))
        still_loaded = loaded(router)
        await wait_until(lambda: loaded(router) == [] and models_of(router) == [],
                         what="idle instance deleted")
        again = await router.embed(embed("embedder"))
        await shutdown(router)
        return still_loaded, again

    still_loaded, again = asyncio.run(main())
    assert still_loaded == ["embedder"]
    assert again.kind == "embedding" and again.load_duration_s > 0
    assert events[:3] == [("start", "embedder"), ("stop", "embedder"), ("start", "embedder")]


def test_a_running_request_holds_its_model_past_the_keep_alive(sources):
    events = []

    async def main():
        router = await make_router(sources, events, keep_alive_s=0.05)
        chunks = await run(router, generate("chat", prompt="hold:0.2"))
        during = ("stop", "chat") in events
        await wait_until(lambda: ("stop", "chat") in events, what="unloaded after")
        await shutdown(router)
        return chunks, during

    chunks, stopped_during_request = asyncio.run(main())
    assert [c.kind for c in chunks] == ["accepted", "finish"]
    assert not stopped_during_request
    assert events.count(("stop", "chat")) == 1  # by the keep-alive, not again at shutdown


def test_request_keep_alive_overrides_the_default(sources):
    events = []

    async def main():
        router = await make_router(sources, events, keep_alive_s=0.05)
        await run(router, generate("chat", keep_alive_s=0))
        await wait_until(lambda: loaded(router) == [], what="unloaded at once")
        await run(router, generate("chat", keep_alive_s=-1))
        await asyncio.sleep(0.15)
        kept = loaded(router), router.supervisors[0].expires_at
        await shutdown(router)
        return kept

    kept, expiry = asyncio.run(main())
    assert kept == ["chat"] and expiry is None


def test_preloaded_models_stay_loaded_unless_a_request_asks(sources):
    events = []

    async def main():
        router = await make_router(sources, events, keep_alive_s=0.01)
        await router.preload(["chat"])
        await run(router, generate("chat"))
        await asyncio.sleep(0.1)
        kept = loaded(router)
        await run(router, generate("chat", keep_alive_s=0.02))
        await wait_until(lambda: loaded(router) == [], what="unloaded as the request asked")
        await shutdown(router)
        return kept

    assert asyncio.run(main()) == ["chat"]


def test_wrong_task_and_unknown_models_are_clear_errors(sources):
    events = []

    async def main():
        router = await make_router(sources, events)
        as_text = await run(router, generate("embedder"))
        as_vectors = await router.embed(embed("chat"))
        unknown = await router.embed(embed("nope"))
        broken = await router.embed(embed("broken"))  # "broken" generates: refused first
        broken_text = await run(router, generate("broken"))
        await wait_until(lambda: models_of(router) == [], what="failed instance deleted")
        await shutdown(router)
        return as_text, as_vectors, unknown, broken, broken_text

    as_text, as_vectors, unknown, broken, broken_text = asyncio.run(main())
    assert [c.kind for c in as_text] == ["error"]
    assert as_text[0].code == "invalid_request" and as_text[0].param == "model"
    assert "embedding model" in as_text[0].message
    assert as_vectors.code == "invalid_request" and as_vectors.param == "model"
    assert "does not produce embeddings" in as_vectors.message
    assert unknown.code == "model_not_found" and unknown.param == "model"
    assert broken.code == "invalid_request"
    assert broken_text[0].code == "unavailable" and "bad weights" in broken_text[0].message
    # nothing was started for the refused requests; the broken model once, not re-placed
    assert [e for e in events if e[0] == "start"] == [("start", "broken")]


def test_load_and_unload_without_a_request(sources):
    events = []

    async def main():
        router = await make_router(sources, events)
        not_loaded = await router.load("chat", keep_alive_s=0)
        loaded_now = await router.load("chat")
        names = loaded(router)
        await router.load("chat", keep_alive_s=0)
        await wait_until(lambda: loaded(router) == [], what="unloaded")
        await shutdown(router)
        return not_loaded, loaded_now, names

    not_loaded, loaded_now, names = asyncio.run(main())
    assert not_loaded is False and loaded_now is True
    assert names == ["chat"]
    assert events == [("start", "chat"), ("stop", "chat")]


def test_empty_embedding_request_only_loads_the_model(sources):
    async def main():
        router = await make_router(sources, [])
        result = await router.embed(embed("embedder", texts=()))
        names = loaded(router)
        await shutdown(router)
        return result, names

    result, names = asyncio.run(main())
    assert result.kind == "embedding" and result.embeddings == () and names == ["embedder"]


def test_shutdown_stops_every_runner_and_pending_timers(sources):
    events = []

    async def main():
        router = await make_router(sources, events, keep_alive_s=30)
        await router.preload(["chat"])
        await router.embed(embed("embedder"))
        await shutdown(router)

    asyncio.run(main())
    assert sorted(e for e in events if e[0] == "stop") == [("stop", "chat"), ("stop", "embedder")]


def test_an_instance_placed_through_the_cluster_serves_requests_until_deleted(sources):
    events = []

    async def main():
        router = await make_router(sources, events, keep_alive_s=0.02)
        facts = model_facts_from_source(sources["chat"])
        await wait_until(lambda: router.cluster.ready and router.cluster.capacities(),
                         what="cluster of one formed")
        instance = await router.cluster.place(PlacementRequest(facts=facts))
        await wait_until(lambda: loaded(router) == ["chat"], what="placed instance started")
        chunks = await run(router, generate("chat"))
        await asyncio.sleep(0.1)  # longer than the node's keep-alive: a placed one stays
        kept = models_of(router)
        assert router.cluster.delete(instance.instance_id)
        await wait_until(lambda: loaded(router) == [], what="deleted instance torn down")
        await shutdown(router)
        return chunks, kept

    chunks, kept = asyncio.run(main())
    assert [c.kind for c in chunks] == ["accepted", "finish"]
    assert kept == ["chat"]
    assert events == [("start", "chat"), ("stop", "chat")]  # the request loaded nothing more
