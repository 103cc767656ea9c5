"""Cancelling a request by id: generating, it ends with finish reason "abort" and the tokens
so far, and its runner stops; queued, it leaves the queue with a "cancelled" error."""

from __future__ import annotations

import asyncio

from memory_pool import generate, make_router, shutdown

from shoal.pool.queue import AdmissionQueue, QueueLimits


def test_a_generating_request_cancelled_by_id_ends_with_abort(sources):
    async def main():
        router = await make_router(sources, [])
        stream = router.submit(generate("chat", "tokens:500:0.01"))
        first = [await anext(stream) for _ in range(4)]
        assert router.cancel("g-tokens:500:0.01")
        rest = [chunk async for chunk in stream]
        instance = router.cluster.state.instances_of("chat")[0]
        runner = router.pool.registry.get((instance.instance_id, 0))
        again = router.cancel("g-tokens:500:0.01")
        await shutdown(router)
        return first, rest, runner.aborted, again

    first, rest, aborted, again = asyncio.run(main())
    assert [c.kind for c in first] == ["accepted", "token", "token", "token"]
    assert len(rest) <= 2 and rest[-1].kind == "finish"  # at most one token was in flight
    assert rest[-1].finish_reason == "abort"
    assert rest[-1].usage.completion_tokens == 3 + (len(rest) - 1)
    assert aborted == ["g-tokens:500:0.01"]  # the runner's stream was closed
    assert again is False  # it is no longer in flight


def test_a_queued_request_cancelled_by_id_leaves_the_queue(sources):
    async def main():
        router = await make_router(sources, [],
                                   queue=AdmissionQueue(QueueLimits(parallel=1)))
        busy = router.submit(generate("chat", "tokens:100:0.01"))
        assert (await anext(busy)).kind == "accepted"
        waiting = asyncio.create_task(
            _collect(router.submit(generate("chat", "tokens:1:0"))))
        while router.queue.depth("chat") == 0:
            await asyncio.sleep(0.005)
        assert router.cancel("g-tokens:1:0")
        cancelled = await waiting
        depth = router.queue.depth()
        unknown = router.cancel("g-nothing")
        await busy.aclose()
        await shutdown(router)
        return cancelled, depth, unknown

    cancelled, depth, unknown = asyncio.run(main())
    assert [c.kind for c in cancelled] == ["error"]
    assert cancelled[0].code == "cancelled" and "cancelled before it started" in \
        cancelled[0].message
    assert depth == 0 and unknown is False


async def _collect(stream) -> list:
    return [chunk async for chunk in stream]


def test_a_stream_cancelled_before_its_pump_ran_still_ends():
    from shoal.router.cancellable import CancellableStream

    async def chunks():
        raise AssertionError("never started")
        yield  # an async generator

    async def main():
        stream = CancellableStream(chunks(), "r1")
        consumer = asyncio.ensure_future(_collect(stream))
        await asyncio.sleep(0)  # the consumer made the pump; the pump has not run
        assert stream.cancel()
        return await asyncio.wait_for(consumer, 2)

    ended = asyncio.run(main())
    assert [c.kind for c in ended] == ["error"] and ended[0].code == "cancelled"
