"""Questions the supervisor asks its runner (Inspect -> Inspection: a trace's spans, the
flight recorder), each answered or given up on within its own bound."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from shoal.runner.messages import Inspect, Inspection


class Inspections:
    def __init__(self) -> None:
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next = 0

    async def ask(self, send: Callable[[Inspect], None], what: str, trace_id: str | None,
                  timeout_s: float) -> dict[str, Any] | None:
        """The runner's answer, or None when it did not come within timeout_s."""
        self._next += 1
        query_id = self._next
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[query_id] = answer
        try:
            send(Inspect(query_id=query_id, what=what, trace_id=trace_id))
            async with asyncio.timeout(timeout_s):
                return await answer
        except TimeoutError:
            return None
        finally:
            self._waiting.pop(query_id, None)

    def answered(self, message: Inspection) -> None:
        answer = self._waiting.get(message.query_id)
        if answer is not None and not answer.done():
            answer.set_result(message.body)
