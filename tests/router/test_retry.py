"""The single retry: a request whose serving runner crashed before its first token is sent
once more, so the client sees no error; a second failure, or one after the first token,
reaches the client."""

from __future__ import annotations

import asyncio

from memory_pool import generate, make_router, run, shutdown


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
