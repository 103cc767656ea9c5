"""Internal chunks -> an Anthropic message, or its SSE stream:

message_start, then per content block content_block_start / content_block_delta... /
content_block_stop (a ping follows the first block's start), then message_delta (stop_reason,
usage) and message_stop. Text streams as text_delta; a reasoning model's reasoning as a
thinking block of thinking_delta (closed by an empty signature_delta: shoal signs nothing);
a tool call as one tool_use block whose input arrives as input_json_delta.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from shoal.api.anthropic.errors import error_body
from shoal.api.errors import APIError
from shoal.api.generation import SSEResponder, collect_reply
from shoal.api.sse import sse_event
from shoal.api.tools import arguments_object, limit_tool_calls
from shoal.protocol import FinishChunk, ToolCall


def stop_reason(finish: FinishChunk, called_tools: bool) -> str:
    if called_tools or finish.finish_reason == "tool_calls":
        return "tool_use"
    if finish.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if finish.stop_sequence else "end_turn"


def usage_json(finish: FinishChunk) -> dict[str, Any]:
    # Anthropic counts prompt tokens read from a cache apart from input_tokens.
    usage = finish.usage
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens, **usage.speculative_json()}


def tool_use_block(call: ToolCall, with_input: bool = True) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name,
            "input": arguments_object(call) if with_input else {}}


def thinking_block(thinking: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def _event(data: dict[str, Any]) -> str:
    return sse_event(data, event=data["type"])


@dataclass
class AnthropicResponder(SSEResponder):
    message_id: str
    model: str
    parallel_tool_use: bool = True
    prompt_tokens: int = 0

    def _message(self, content: list[dict[str, Any]], finish: FinishChunk | None,
                 called_tools: bool) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "model": self.model, "content": content,
                "stop_reason": stop_reason(finish, called_tools) if finish else None,
                "stop_sequence": finish.stop_sequence if finish else None,
                "usage": usage_json(finish) if finish else
                {"input_tokens": self.prompt_tokens, "output_tokens": 0}}

    async def to_json(self, chunks: AsyncIterator[Any]) -> dict[str, Any]:
        reply = await collect_reply(limit_tool_calls(chunks, self.parallel_tool_use))
        content = [thinking_block(reply.reasoning)] if reply.reasoning else []
        content += [{"type": "text", "text": reply.text}] if reply.text else []
        content += [tool_use_block(call) for call in reply.tool_calls]
        return self._message(content, reply.finish, bool(reply.tool_calls))

    async def to_stream(self, chunks: AsyncIterator[Any]) -> AsyncIterator[str]:
        yield _event({"type": "message_start", "message": self._message([], None, False)})
        blocks = _BlockWriter()
        called_tools = False
        async for chunk in limit_tool_calls(chunks, self.parallel_tool_use):
            if chunk.kind == "token" and chunk.text:
                for event in blocks.text(chunk.text):
                    yield event
            elif chunk.kind == "reasoning" and chunk.text:
                for event in blocks.thinking(chunk.text):
                    yield event
            elif chunk.kind == "tool_call":
                try:
                    events = blocks.tool_use(chunk.call)
                except APIError as error:
                    yield _event(error_body(error))
                    return
                called_tools = True
                for event in events:
                    yield event
            elif chunk.kind == "finish":
                for event in blocks.finish():
                    yield event
                yield _event({"type": "message_delta",
                              "delta": {"stop_reason": stop_reason(chunk, called_tools),
                                        "stop_sequence": chunk.stop_sequence},
                              "usage": usage_json(chunk)})
                yield _event({"type": "message_stop"})
                return
            elif chunk.kind == "error":
                yield _event(error_body(APIError.from_chunk(chunk)))
                return


class _BlockWriter:
    """Numbers content blocks, keeps one text or thinking block open across deltas, pings
    once."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the kind of the open block: "text", "thinking"
        self.pinged = False

    def _start(self, block: dict[str, Any]) -> list[str]:
        self.index += 1
        events = [_event({"type": "content_block_start", "index": self.index,
                          "content_block": block})]
        if not self.pinged:
            self.pinged = True
            events.append(_event({"type": "ping"}))
        return events

    def _stop(self) -> str:
        return _event({"type": "content_block_stop", "index": self.index})

    def text(self, text: str) -> list[str]:
        return self._delta({"type": "text", "text": ""}, {"type": "text_delta", "text": text})

    def thinking(self, thinking: str) -> list[str]:
        return self._delta(thinking_block(""), {"type": "thinking_delta", "thinking": thinking})

    def _delta(self, block: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        """delta in the open block of block's kind, opened (the other one closed) if need be."""
        events = []
        if self.open != block["type"]:
            events = self.close() + self._start(block)
            self.open = block["type"]
        events.append(_event({"type": "content_block_delta", "index": self.index,
                              "delta": delta}))
        return events

    def tool_use(self, call: ToolCall) -> list[str]:
        arguments = json.dumps(arguments_object(call), ensure_ascii=False)
        events = self.close()
        events += self._start(tool_use_block(call, with_input=False))
        events.append(_event({"type": "content_block_delta", "index": self.index,
                              "delta": {"type": "input_json_delta", "partial_json": arguments}}))
        events.append(self._stop())
        return events

    def close(self) -> list[str]:
        """Close the open text or thinking block, if any."""
        events = []
        if self.open == "thinking":
            events.append(_event({"type": "content_block_delta", "index": self.index,
                                  "delta": {"type": "signature_delta", "signature": ""}}))
        if self.open is not None:
            events.append(self._stop())
        self.open = None
        return events

    def finish(self) -> list[str]:
        """Close the last block; ping now if no block was ever started."""
        events = self.close()
        if not self.pinged:
            self.pinged = True
            events.append(_event({"type": "ping"}))
        return events
