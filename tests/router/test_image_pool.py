"""Image models in the node's pool, through the router over in-memory runners
(tests/memory_pool.py): a budget for one model has an image model and a chat model evict
each other; an image model's requests take turns in the queue; keep-alive unloads it; a
request naming a model of the other kind is refused, naming the model parameter."""

from __future__ import annotations

import asyncio

from memory_pool import draw, generate, loaded, make_router, one_model_budget, run, shutdown

from shoal.router import Router


async def drawing(router: Router, request) -> list:
    return [chunk async for chunk in router.generate_images(request)]


def kinds(chunks) -> list[str]:
    return [c.kind for c in chunks]


def test_an_image_model_and_a_chat_model_evict_each_other_within_a_budget(sources):
    events = []

    async def main():
        router = await make_router(sources, events, memory_budget=one_model_budget(sources))
        await run(router, generate("chat"))
        image = await drawing(router, draw("painter"))
        after_image = loaded(router)
        # Another chat model: "chat"'s measured size (once loaded) would fit beside it.
        chat = await run(router, generate("other"))
        after_chat = loaded(router)
        await shutdown(router)
        return image, after_image, chat, after_chat

    image, after_image, chat, after_chat = asyncio.run(main())
    assert kinds(image) == ["image_progress", "image_progress", "image", "images_done"]
    assert after_image == ["painter"] and after_chat == ["other"]
    assert kinds(chat) == ["accepted", "finish"]
    starts_and_stops = [e for e in events if e[0] in ("start", "stop")]
    assert starts_and_stops[:5] == [("start", "chat"), ("stop", "chat"), ("start", "painter"),
                                    ("stop", "painter"), ("start", "other")]


def test_image_requests_take_turns_in_the_queue(sources):
    events = []

    async def main():
        router = await make_router(sources, events)
        await drawing(router, draw("painter", "warm"))
        first = asyncio.create_task(drawing(router, draw("painter", "a", prompt="hold:0.3")))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(drawing(router, draw("painter", "b")))
        await asyncio.sleep(0.05)
        waiting = router.queue.depth("painter"), router.queue.running("painter")
        results = await asyncio.gather(first, second)
        await shutdown(router)
        return waiting, results

    waiting, results = asyncio.run(main())
    assert waiting == (1, 1)  # b waits for its turn while a draws
    assert [kinds(r)[-1] for r in results] == ["images_done", "images_done"]
    draws = [e for e in events if e[0] in ("draw", "drawn")]
    assert draws[-4:] == [("draw", "a"), ("drawn", "a"), ("draw", "b"), ("drawn", "b")]


def test_keep_alive_unloads_an_idle_image_model(sources):
    events = []

    async def main():
        router = await make_router(sources, events)
        await drawing(router, draw("painter", keep_alive_s=0.1))
        loaded_after = loaded(router)
        for _ in range(100):
            if not loaded(router):
                break
            await asyncio.sleep(0.05)
        gone = loaded(router)
        await shutdown(router)
        return loaded_after, gone

    loaded_after, gone = asyncio.run(main())
    assert loaded_after == ["painter"] and gone == []


def test_a_request_for_the_other_kind_of_model_is_refused_naming_the_model(sources):
    async def main():
        router = await make_router(sources, [])
        as_chat = await run(router, generate("painter"))
        as_image = await drawing(router, draw("chat"))
        await shutdown(router)
        return as_chat, as_image

    as_chat, as_image = asyncio.run(main())
    for refused in (as_chat, as_image):
        assert kinds(refused) == ["error"]
        assert refused[0].code == "invalid_request" and refused[0].param == "model"
    assert "is an image model" in as_chat[0].message
    assert "/v1/images/generations" in as_chat[0].message
    assert "generates text" in as_image[0].message and "draw images" in as_image[0].message


def test_cancel_ends_a_drawing_and_names_the_steps_it_ran(sources):
    async def main():
        router = await make_router(sources, [])
        stream = router.generate_images(draw("painter", "long", prompt="hold:5"))
        first = await anext(stream)
        cancelled = router.cancel("long")
        last = await asyncio.wait_for(anext(stream), 2)
        after = router.queue.running("painter")
        await stream.aclose()
        await shutdown(router)
        return first, cancelled, last, after

    first, cancelled, last, after = asyncio.run(main())
    assert first.kind == "image_progress" and cancelled
    assert last.kind == "error" and last.code == "cancelled"
    assert "after 1 denoising step" in last.message
    assert after == 0  # its turn was given back
