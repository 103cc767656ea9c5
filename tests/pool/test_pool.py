"""The model pool (through the router): loading on first use, sharing one load, task checks,
keep-alive unloads, and hosting for cluster instances, over in-memory supervisors (no
subprocesses; keep-alive times of tens of milliseconds)."""

from __future__ import annotations

import asyncio

from memory_pool import LOAD_S, embed, generate, loaded, make_router, run, sources  # noqa: F401


def test_models_load_on_first_use_and_concurrent_first_requests_share_one_load(sources):
    events = []

    async def main():
        router = make_router(sources, events)
        assert router.supervisors == []
        results = await asyncio.gather(*(router.embed(embed("embedder")) for _ in range(4)))
        state = loaded(router), router.supervisors[0].expires_at
        await router.shutdown()
        return results, state

    results, (names, expires_at) = asyncio.run(main())
    assert events.count(("start", "embedder")) == 1
    assert all(r.kind == "embedding" and r.embeddings == ((1.0, 0.0),) for r in results)
    assert max(r.load_duration_s for r in results) >= LOAD_S * 0.9
    assert names == ["embedder"] and expires_at is not None  # default keep-alive: 300 s


def test_idle_models_unload_after_keep_alive_and_reload_on_next_use(sources):
    events = []

    async def main():
        router = make_router(sources, events, keep_alive_s=0.1)
        await router.embed(embed("embedder"))
        still_loaded = loaded(router)
        await asyncio.sleep(0.25)
        after_idle = loaded(router)
        again = await router.embed(embed("embedder"))
        await router.shutdown()
        return still_loaded, after_idle, again

    still_loaded, after_idle, again = asyncio.run(main())
    assert still_loaded == ["embedder"] and after_idle == []
    assert again.kind == "embedding" and again.load_duration_s > 0
    assert events[:3] == [("start", "embedder"), ("stop", "embedder"), ("start", "embedder")]


def test_a_running_request_holds_its_model_past_the_keep_alive(sources):
    events = []

    async def main():
        router = make_router(sources, events, keep_alive_s=0.05)
        chunks = await run(router, generate("chat", prompt="hold:0.2"))
        during = ("stop", "chat") in events
        await asyncio.sleep(0.15)
        await router.shutdown()
        return chunks, during

    chunks, stopped_during_request = asyncio.run(main())
    assert [c.kind for c in chunks] == ["accepted", "finish"]
    assert not stopped_during_request
    assert events.count(("stop", "chat")) == 1  # by the keep-alive, not again at shutdown


def test_request_keep_alive_overrides_the_default(sources):
    events = []

    async def main():
        router = make_router(sources, events, keep_alive_s=0.05)
        await run(router, generate("chat", keep_alive_s=0))
        await asyncio.sleep(0.01)
        unloaded_at_once = loaded(router)
        await run(router, generate("chat", keep_alive_s=-1))
        await asyncio.sleep(0.15)
        kept = loaded(router), router.supervisors[0].expires_at
        await router.shutdown()
        return unloaded_at_once, kept

    unloaded_at_once, (kept, expiry) = asyncio.run(main())
    assert unloaded_at_once == []
    assert kept == ["chat"] and expiry is None


def test_preloaded_models_stay_loaded_unless_a_request_asks(sources):
    events = []

    async def main():
        router = make_router(sources, events, keep_alive_s=0.01)
        await router.preload(["chat"])
        await run(router, generate("chat"))
        await asyncio.sleep(0.1)
        pinned = loaded(router)
        await run(router, generate("chat", keep_alive_s=0.02))
        await asyncio.sleep(0.1)
        asked = loaded(router)
        await run(router, generate("chat"))  # loads again, pinned again
        await asyncio.sleep(0.1)
        reloaded = loaded(router)
        await router.shutdown()
        return pinned, asked, reloaded

    pinned, asked, reloaded = asyncio.run(main())
    assert pinned == ["chat"] and asked == [] and reloaded == ["chat"]


def test_wrong_task_and_unknown_models_are_clear_errors(sources):
    async def main():
        router = make_router(sources, [])
        as_text = await run(router, generate("embedder"))
        as_vectors = await router.embed(embed("chat"))
        unknown = await router.embed(embed("nope"))
        broken = await router.embed(embed("broken"))  # "broken" generates: refused first
        broken_text = await run(router, generate("broken"))
        names = loaded(router)
        await router.shutdown()
        return as_text, as_vectors, unknown, broken, broken_text, names

    as_text, as_vectors, unknown, broken, broken_text, names = asyncio.run(main())
    assert [c.kind for c in as_text] == ["error"]
    assert as_text[0].code == "invalid_request" and as_text[0].param == "model"
    assert "embedding model" in as_text[0].message
    assert as_vectors.code == "invalid_request" and as_vectors.param == "model"
    assert "does not produce embeddings" in as_vectors.message
    assert unknown.code == "model_not_found" and unknown.param == "model"
    assert broken.code == "invalid_request"
    assert broken_text[0].code == "unavailable" and "bad weights" in broken_text[0].message
    assert names == ["broken"]  # nothing was started for the refused requests


def test_load_and_unload_without_a_request(sources):
    events = []

    async def main():
        router = make_router(sources, events)
        not_loaded = await router.load("chat", keep_alive_s=0)
        loaded_now = await router.load("chat")
        names = loaded(router)
        await router.load("chat", keep_alive_s=0)
        await asyncio.sleep(0.01)
        await router.shutdown()
        return not_loaded, loaded_now, names, loaded(router)

    not_loaded, loaded_now, names, after = asyncio.run(main())
    assert not_loaded is False and loaded_now is True
    assert names == ["chat"] and after == []
    assert events == [("start", "chat"), ("stop", "chat")]


def test_empty_embedding_request_only_loads_the_model(sources):
    async def main():
        router = make_router(sources, [])
        result = await router.embed(embed("embedder", texts=()))
        names = loaded(router)
        await router.shutdown()
        return result, names

    result, names = asyncio.run(main())
    assert result.kind == "embedding" and result.embeddings == () and names == ["embedder"]


def test_shutdown_stops_every_runner_and_pending_timers(sources):
    events = []

    async def main():
        router = make_router(sources, events, keep_alive_s=30)
        await router.preload(["chat"])
        await router.embed(embed("embedder"))
        await router.shutdown()

    asyncio.run(main())
    assert sorted(e for e in events if e[0] == "stop") == [("stop", "chat"), ("stop", "embedder")]


def test_hosting_pins_a_model_past_its_keep_alive_until_the_last_instance_lets_go(sources):
    events = []

    async def main():
        router = make_router(sources, events, keep_alive_s=0.02)
        pool = router.pool
        await pool.host("chat", "inst-a")
        await pool.host("chat", "inst-b")
        await run(router, generate("chat", keep_alive_s=0))  # a request cannot unload it
        await asyncio.sleep(0.1)
        hosted = [(r.model_id, r.hosted, r.generation) for r in pool.residencies()]
        pool.unhost("chat", "inst-a")
        await asyncio.sleep(0.05)
        one_left = loaded(router)
        pool.unhost("chat", "inst-b")
        await asyncio.sleep(0.05)
        gone = loaded(router)
        await pool.host("chat", "inst-c")
        again = [(r.model_id, r.generation) for r in pool.residencies()]
        await router.shutdown()
        return hosted, one_left, gone, again

    hosted, one_left, gone, again = asyncio.run(main())
    assert hosted == [("chat", True, 1)]
    assert one_left == ["chat"] and gone == []
    assert again == [("chat", 2)]  # a fresh runner: a new generation
    assert events.count(("start", "chat")) == 2


def test_unhosting_keeps_a_model_named_at_start_and_unload_stops_one_at_once(sources):
    events = []

    async def main():
        router = make_router(sources, events, keep_alive_s=30)
        pool = router.pool
        changes = []
        pool.on_change(changes.append)
        await router.preload(["chat"])
        await pool.host("chat", "inst-a")
        pool.unhost("chat", "inst-a")
        await asyncio.sleep(0.02)
        kept = loaded(router)
        pool.unload("chat")
        await asyncio.sleep(0.02)
        await router.shutdown()
        return kept, loaded(router), changes

    kept, after, changes = asyncio.run(main())
    assert kept == ["chat"] and after == []
    assert changes.count("chat") >= 3  # starting, started, unloaded
