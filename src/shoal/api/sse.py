"""Streamed bodies: server-sent events, newline-delimited JSON, keep-alives on silent streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n\n"


def compact_json(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(',', ':'))


def sse_event(data: Any, event: str | None = None) -> str:
    """One `data:` event holding data as compact JSON, named by an `event:` line if given."""
    name = f"event: {event}\n" if event else ""
    return f"{name}data: {compact_json(data)}\n\n"


def ndjson_line(data: Any) -> str:
    """One line of newline-delimited JSON."""
    return compact_json(data) + "\n"


async def with_keepalive(events: AsyncIterator[str], interval_s: float,
                         keepalive: str = KEEPALIVE) -> AsyncIterator[str]:
    """Pass events through, adding keepalive whenever interval_s pass without an event.

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
                yield keepalive
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
