"""Server-sent events: framing and keep-alive comments on silent streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n\n"


def sse_event(data: Any) -> str:
    """One `data:` event holding data as compact JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def with_keepalive(events: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """Pass events through, adding a comment line whenever interval_s pass without one.

    Proxies and clients drop idle connections; a comment keeps them open while a model loads
    or a long prompt is prefilled. Closing this iterator closes events.
    """
    iterator = aiter(events)
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEPALIVE
                continue
            task, pending = pending, None
            try:
                yield task.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
