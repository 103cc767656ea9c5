"""The single retry: a request whose serving runner crashed before its first token is sent
once more, so the client sees no error (a token whose text was still held back counts as
none); a second failure, or one after the first token, reaches the client."""

from __future__ import annotations

import asyncio

from memory_pool import generate, make_router, run, shutdown

from shoal.protocol import AcceptedChunk, ErrorChunk, TokenChunk
from shoal.router.relay import Relay


def attempts(router) -> list[str]:
    return [rid for s in router.pool.registry.supervisors for rid in s.submitted]


def test_a_runner_crash_before_the_first_token_is_retried_once_unseen(sources, tmp_path):
    marker = tmp_path / "crash-once"
    marker.touch()

    async def main():
        router = await make_router(sources, [])
        try:
            return await run(router, generate("chat", f"crash-once:{marker}")), attempts(router)
        finally:
            await shutdown(router)

    chunks, tried = asyncio.run(main())
    assert [c.kind for c in chunks] == ["accepted", "token", "token", "finish"]
    assert {c.request_id for c in chunks} == {f"g-crash-once:{marker}"}
    assert len(tried) == 2 and tried[1] == f"{tried[0]}~retry"


def test_a_crash_after_a_held_back_token_is_retried_and_the_lost_token_never_shows(
        sources, tmp_path):
    marker = tmp_path / "crash-once"
    marker.touch()

    async def main():
        router = await make_router(sources, [])
        try:
            return await run(router, generate("chat", f"held-crash-once:{marker}")), \
                attempts(router)
        finally:
            await shutdown(router)

    chunks, tried = asyncio.run(main())
    assert [c.kind for c in chunks] == ["accepted", "token", "token", "finish"]
    assert [c.text for c in chunks if c.kind == "token"] == ["t0 ", "t1 "]
    assert len(tried) == 2 and tried[1] == f"{tried[0]}~retry"


def test_held_back_chunks_go_out_before_the_first_one_that_shows_something():
    relay = Relay("r")
    held = TokenChunk(request_id="r", text="", token_ids=(7,))
    shown = TokenChunk(request_id="r", text="é", token_ids=(8,))
    assert relay.pass_on(AcceptedChunk(request_id="r", prompt_tokens=1))
    assert relay.pass_on(held) == [] and not relay.started
    lost = ErrorChunk(request_id="r", code="runner_crashed", message="gone")
    assert relay.lost(lost, retry_left=True) and not relay.lost(lost, retry_left=False)
    assert relay.pass_on(shown) == [held, shown] and relay.started
    assert not relay.lost(lost, retry_left=True)  # the client has seen the answer begin


def test_a_second_crash_reaches_the_client_with_its_error(sources):
    async def main():
        router = await make_router(sources, [])
        try:
            return await run(router, generate("chat", "crash")), attempts(router)
        finally:
            await shutdown(router)

    chunks, tried = asyncio.run(main())
    assert [c.kind for c in chunks] == ["accepted", "error"]
    assert chunks[-1].code == "runner_crashed" and chunks[-1].request_id == "g-crash"
    assert tried == ["g-crash", "g-crash~retry"]  # once retried, never twice
