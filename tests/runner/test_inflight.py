"""In-flight requests of one runner: ordered delivery, bounded buffering, cancellation."""

from __future__ import annotations

import asyncio

from shoal.protocol import FinishChunk, TokenChunk, Usage
from shoal.runner.inflight import InFlight


def token(request_id: str, text: str) -> TokenChunk:
    return TokenChunk(request_id=request_id, text=text, token_ids=(1,))


def finish(request_id: str) -> FinishChunk:
    return FinishChunk(request_id=request_id, finish_reason="stop",
                       usage=Usage(prompt_tokens=1, completion_tokens=1))


def table(cancelled: list[str], max_chunks: int = 4, timeout_s: float = 5.0) -> InFlight:
    return InFlight(max_chunks, timeout_s, cancelled.append)


def test_chunks_arrive_in_order_and_nothing_after_the_finish():
    async def main():
        cancelled: list[str] = []
        requests = table(cancelled)
        pending = requests.open("a")
        for chunk in (token("a", "x"), token("a", "y"), finish("a"), token("a", "late")):
            requests.deliver(chunk)
        requests.deliver(token("unknown", "z"))  # a request no one holds: dropped
        got = [await requests.next_chunk("a", pending) for _ in range(3)]
        requests.close("a", pending)
        return got, pending.queue.empty(), cancelled, len(requests)

    got, drained, cancelled, left = asyncio.run(main())
    assert [c.kind for c in got] == ["token", "token", "finish"]
    assert [c.text for c in got[:2]] == ["x", "y"]
    assert drained and cancelled == [] and left == 0  # finished: nothing to cancel


def test_a_reader_that_falls_behind_is_cancelled_with_an_error():
    async def main():
        cancelled: list[str] = []
        requests = table(cancelled, max_chunks=2)
        pending = requests.open("a")
        for i in range(3):  # one more than the queue holds
            requests.deliver(token("a", str(i)))
        requests.deliver(finish("a"))  # after the overflow: ignored
        return await requests.next_chunk("a", pending), pending.queue.empty(), cancelled

    chunk, drained, cancelled = asyncio.run(main())
    assert chunk.kind == "error" and chunk.code == "overloaded"
    assert "fast enough" in chunk.message
    assert drained and cancelled == ["a"]


def test_closing_early_cancels_in_the_runner():
    async def main():
        cancelled: list[str] = []
        requests = table(cancelled)
        pending = requests.open("a")
        requests.deliver(token("a", "x"))
        requests.close("a", pending)
        return cancelled, "a" in requests

    assert asyncio.run(main()) == (["a"], False)


def test_server_cancel_and_runner_loss_end_readers_with_errors():
    async def main():
        cancelled: list[str] = []
        requests = table(cancelled)
        first, second = requests.open("a"), requests.open("b")
        requests.cancel("a", "the request was cancelled by the server")
        requests.fail_all("runner_crashed", "the runner died")
        return (await requests.next_chunk("a", first), await requests.next_chunk("b", second),
                cancelled)

    first, second, cancelled = asyncio.run(main())
    assert (first.code, first.message) == ("invalid_request",
                                           "the request was cancelled by the server")
    assert (second.code, second.message) == ("runner_crashed", "the runner died")
    assert cancelled == ["a"]  # only the request the server gave up on is sent a cancel


def test_a_silent_runner_turns_into_a_timeout_error():
    async def main():
        requests = table([], timeout_s=0.05)
        return await requests.next_chunk("a", requests.open("a"))

    chunk = asyncio.run(main())
    assert chunk.kind == "error" and chunk.code == "timeout"
