"""The memory-gated pool through the router on a standalone node, over in-memory runners:
a budget that holds one model evicts the idle one for the next, never a busy or pinned one;
--max-loaded-models; a model larger than the budget; fallback ladders; where the time of a
failed request went."""

from __future__ import annotations

import asyncio
import time

from memory_pool import (
    HELD_BYTES,
    generate,
    loaded,
    make_router,
    run,
    shutdown,
)

from shoal.cluster.model_facts import model_facts_from_source
from shoal.cluster.placement import bytes_to_find, shard_bytes
from shoal.router.ladders import Ladder

MIB = 2**20


def one_model_budget(sources) -> int:
    """Room for one model as placement estimates it, not for two (a loaded one counts
    HELD_BYTES once it reports, its estimate until then)."""
    facts = model_facts_from_source(sources["chat"])
    needed = shard_bytes(facts, facts.n_layers)
    assert needed > 2 * HELD_BYTES
    # An estimate is tried when at most 15% over the room: that much room is enough.
    return bytes_to_find(facts, needed, whole=True) + HELD_BYTES // 2


def kinds(chunks) -> list[str]:
    return [c.kind for c in chunks]


def test_a_model_that_does_not_fit_evicts_the_idle_one_and_is_answered(sources):
    events = []

    async def main():
        router = await make_router(sources, events, memory_budget=one_model_budget(sources))
        first = await run(router, generate("chat"))
        second = await run(router, generate("other"))
        names = loaded(router)
        await shutdown(router)
        return first, second, names

    first, second, names = asyncio.run(main())
    assert kinds(first) == kinds(second) == ["accepted", "finish"]
    assert second[0].model == "other"
    assert names == ["other"]
    assert events[:3] == [("start", "chat"), ("stop", "chat"), ("start", "other")]


def test_a_model_with_a_request_in_flight_is_evicted_only_once_it_ends(sources):
    events = []

    async def main():
        router = await make_router(sources, events, memory_budget=one_model_budget(sources))
        await run(router, generate("chat"))
        busy = asyncio.create_task(run(router, generate("chat", prompt="hold:0.3")))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        other = await run(router, generate("other"))
        waited = time.monotonic() - started
        held = await busy
        await shutdown(router)
        return held, other, waited

    held, other, waited = asyncio.run(main())
    assert kinds(held) == ["accepted", "finish"]  # not cut short by the eviction
    assert kinds(other) == ["accepted", "finish"]
    assert waited >= 0.2
    assert events.index(("stop", "chat")) < events.index(("start", "other"))


def test_a_pinned_model_is_never_evicted_and_the_other_request_is_told_why(sources):
    events = []

    async def main():
        router = await make_router(sources, events, memory_budget=one_model_budget(sources))
        await router.preload(["chat"], pinned=True)
        started = time.monotonic()
        refused = await run(router, generate("other"))
        took = time.monotonic() - started
        names = loaded(router)
        await shutdown(router)
        return refused, took, names

    refused, took, names = asyncio.run(main())
    assert kinds(refused) == ["error"] and refused[0].code == "unavailable"
    message = refused[0].message
    assert "memory budget" in message and "chat" in message and "pinned" in message
    assert "(time: queue" in message and "load" in message
    assert took < 2.0  # refused at once: waiting could not help
    assert names == ["chat"]


def test_max_loaded_models_evicts_by_count(sources):
    events = []

    async def main():
        router = await make_router(sources, events, max_loaded_models=1)
        await run(router, generate("chat"))
        answer = await run(router, generate("other"))
        names = loaded(router)
        await shutdown(router)
        return answer, names

    answer, names = asyncio.run(main())
    assert kinds(answer) == ["accepted", "finish"]
    assert names == ["other"]
    assert ("stop", "chat") in events


def test_a_model_larger_than_the_budget_is_refused_at_once_with_the_sizes(sources):
    async def main():
        router = await make_router(sources, [], memory_budget=64 * MIB)
        refused = await run(router, generate("chat"))
        await shutdown(router)
        return refused

    refused = asyncio.run(main())
    assert refused[0].code == "unavailable"
    assert "needs about" in refused[0].message and "budget is 0.06 GiB" in refused[0].message


def test_a_waiting_request_is_told_what_holds_the_memory_when_its_wait_ends(sources):
    async def main():
        router = await make_router(sources, [], memory_budget=one_model_budget(sources),
                                   memory_wait_s=0.2)
        await run(router, generate("chat"))
        busy = asyncio.create_task(run(router, generate("chat", prompt="hold:1.0")))
        await asyncio.sleep(0.05)
        refused = await run(router, generate("other"))
        await busy
        await shutdown(router)
        return refused

    refused = asyncio.run(main())
    message = refused[0].message
    assert refused[0].code == "unavailable"
    assert "in use" in message and "waited 0 s" in message and "chat" in message


def test_a_task_ladder_serves_the_loaded_rung_and_names_it(sources):
    events = []
    ladders = {"code": Ladder(name="code", models=("chat", "other"), budget_s=5.0)}

    async def main():
        router = await make_router(sources, events, ladders=ladders)
        await run(router, generate("other"))
        served = await run(router, generate("task:code"))
        unknown = await run(router, generate("task:nope"))
        await shutdown(router)
        return served, unknown

    served, unknown = asyncio.run(main())
    assert served[0].kind == "accepted" and served[0].model == "other"
    assert events.count(("start", "chat")) == 0  # the loaded rung served, nothing loaded
    assert unknown[0].code == "model_not_found" and "'nope'" in unknown[0].message


def test_a_ladder_falls_back_past_a_rung_that_cannot_load(sources):
    ladders = {"code": Ladder(name="code", models=("broken", "chat"), budget_s=5.0),
               "strict": Ladder(name="strict", models=("broken", "chat"), pin_primary=True)}

    async def main():
        router = await make_router(sources, [], ladders=ladders)
        stream = router.submit(generate("task:code", prompt="hold:0.3"))
        fell_back = [await anext(stream)]
        # The turn is now counted against the rung that serves, not the first one.
        running = router.queue.running("chat"), router.queue.running("broken")
        fell_back += [chunk async for chunk in stream]
        strict = await run(router, generate("task:strict", prompt="again"))
        await shutdown(router)
        return fell_back, running, strict

    fell_back, running, strict = asyncio.run(main())
    assert fell_back[0].model == "chat" and kinds(fell_back) == ["accepted", "finish"]
    assert running == (1, 0)
    # pin_primary serves the first rung only, though another is loaded: its failure is the
    # answer, no fallback.
    assert strict[0].kind == "error" and "broken" in strict[0].message
