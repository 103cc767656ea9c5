"""A request's chunk stream that another task can end (POST /v1/requests/{id}/cancel).

An async generator cannot be closed from outside while it waits, so the stream runs in its
own pump task that hands chunks over through an unbounded queue (at most a request's
tokens). Cancelling cancels the pump: the stream's own cleanup runs where it waits (the
queue turn is given back, the runner aborts the request, a remote task is cancelled), as when
a client goes away. The consumer then gets one last chunk: a Finish with reason "abort" and
the tokens so far once the request was accepted, else an ErrorChunk ("cancelled"; an image
request's names the denoising steps it ran).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from shoal.protocol import ErrorChunk, FinishChunk, Usage

_END = object()
TERMINAL_KINDS = ("finish", "error", "images_done")


class CancellableStream:
    def __init__(self, stream: AsyncIterator[Any], request_id: str) -> None:
        self.request_id = request_id
        self._stream = stream
        self._chunks: asyncio.Queue[Any] = asyncio.Queue()
        self._pump: asyncio.Task[None] | None = None
        self._cancelled = False
        self._error: BaseException | None = None  # the stream's own failure, re-raised

    async def __aiter__(self) -> AsyncIterator[Any]:
        self._pump = asyncio.create_task(self._run(), name=f"stream-{self.request_id}")
        prompt_tokens: int | None = None
        generated = 0
        steps = 0  # an image request's denoising steps so far
        try:
            while True:
                chunk = await self._chunks.get()
                if chunk is _END:
                    if self._error is not None:
                        raise self._error
                    if self._cancelled:
                        yield self._last_chunk(prompt_tokens, generated, steps)
                    return
                if chunk.kind == "accepted":
                    prompt_tokens = chunk.prompt_tokens
                elif chunk.kind in ("token", "reasoning"):
                    generated += len(chunk.token_ids)
                elif chunk.kind == "image_progress":
                    steps = chunk.step
                yield chunk
                if chunk.kind in TERMINAL_KINDS:
                    return
        finally:
            await self.close()

    def cancel(self) -> bool:
        """End the stream; False when it has already ended."""
        if self._pump is None or self._pump.done():
            return False
        self._cancelled = True
        self._pump.cancel()
        # A pump cancelled before its first step never reaches its finally: wake the
        # consumer here too (a second end marker is never read).
        self._chunks.put_nowait(_END)
        return True

    async def close(self) -> None:
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump

    async def _run(self) -> None:
        try:
            async for chunk in self._stream:
                self._chunks.put_nowait(chunk)
        except Exception as error:  # noqa: BLE001 - handed to the consumer, raised there
            self._error = error
        finally:
            with contextlib.suppress(BaseException):
                await self._stream.aclose()
            self._chunks.put_nowait(_END)

    def _last_chunk(self, prompt_tokens: int | None, generated: int, steps: int) -> Any:
        if steps:
            return ErrorChunk(request_id=self.request_id, code="cancelled",
                              message=f"request {self.request_id} was cancelled after "
                                      f"{steps} denoising step(s) "
                                      "(POST /v1/requests/{id}/cancel)")
        if prompt_tokens is None:
            return ErrorChunk(request_id=self.request_id, code="cancelled",
                              message=f"request {self.request_id} was cancelled before it "
                                      "started (POST /v1/requests/{id}/cancel)")
        return FinishChunk(request_id=self.request_id, finish_reason="abort",
                           usage=Usage(prompt_tokens=prompt_tokens,
                                       completion_tokens=generated))
