"""Internal chunks -> an OpenAI Responses object, or its SSE event stream:

response.created, response.in_progress; for a reasoning model's reasoning, one reasoning item
(output_item.added, reasoning_text.delta..., reasoning_text.done, output_item.done); for
text, one message item
(output_item.added, content_part.added, output_text.delta..., output_text.done,
content_part.done, output_item.done); for each tool call, one function_call item
(output_item.added, function_call_arguments.delta / .done, output_item.done); then
response.completed (response.incomplete when max_output_tokens cut it short, response.failed
on an error). Every event carries a sequence_number counting from 0.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from shoal.api.errors import APIError
from shoal.api.generation import SSEResponder, collect_reply
from shoal.api.sse import sse_event
from shoal.api.tools import limit_tool_calls
from shoal.protocol import FinishChunk, ToolCall


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_json(finish: FinishChunk) -> dict[str, Any]:
    usage = finish.usage
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.total_tokens, **usage.speculative_json()}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A message output item; text None while it is only being opened."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if text is None else [text_part(text)]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def function_call_item(item_id: str, call: ToolCall, status: str = "completed"
                       ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


def _status(finish: FinishChunk) -> tuple[str, dict[str, str] | None]:
    if finish.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _error_code(error: APIError) -> str:
    if error.status == 429:
        return "rate_limit_exceeded"
    return "server_error" if error.status >= 500 else "invalid_prompt"


@dataclass
class ResponsesResponder(SSEResponder):
    response_id: str
    model: str
    echo: dict[str, Any]  # the request settings the response repeats (responses.request_echo)
    prompt_tokens: int = 0
    created_at: int = field(default_factory=lambda: int(time.time()))

    def _response(self, status: str, output: list[dict[str, Any]],
                  finish: FinishChunk | None = None,
                  incomplete: dict[str, str] | None = None,
                  error: dict[str, str] | None = None) -> dict[str, Any]:
        return {"id": self.response_id, "object": "response", "created_at": self.created_at,
                "status": status, "error": error, "incomplete_details": incomplete,
                "model": self.model, "output": output,
                "usage": usage_json(finish) if finish else None, **self.echo}

    @property
    def _parallel(self) -> bool:
        return self.echo.get("parallel_tool_calls", True)

    async def to_json(self, chunks: AsyncIterator[Any]) -> dict[str, Any]:
        reply = await collect_reply(limit_tool_calls(chunks, self._parallel))
        status, incomplete = _status(reply.finish)
        output = [reasoning_item(_item_id("rs"), reply.reasoning, "completed")] \
            if reply.reasoning else []
        if reply.text or not reply.tool_calls:
            output.append(message_item(_item_id("msg"), reply.text, status))
        output += [function_call_item(_item_id("fc"), call) for call in reply.tool_calls]
        return self._response(status, output, reply.finish, incomplete)

    async def to_stream(self, chunks: AsyncIterator[Any]) -> AsyncIterator[str]:
        events = _EventWriter()
        in_progress = self._response("in_progress", [])
        yield events.emit("response.created", response=in_progress)
        yield events.emit("response.in_progress", response=in_progress)
        async for chunk in limit_tool_calls(chunks, self._parallel):
            if chunk.kind == "token" and chunk.text:
                for event in events.text(chunk.text):
                    yield event
            elif chunk.kind == "reasoning" and chunk.text:
                for event in events.reasoning(chunk.text):
                    yield event
            elif chunk.kind == "tool_call":
                for event in events.function_call(chunk.call):
                    yield event
            elif chunk.kind == "finish":
                status, incomplete = _status(chunk)
                for event in events.finish(status):
                    yield event
                final = self._response(status, events.output, chunk, incomplete)
                kind = "response.completed" if status == "completed" else "response.incomplete"
                yield events.emit(kind, response=final)
                return
            elif chunk.kind == "error":
                error = APIError.from_chunk(chunk)
                failed = self._response("failed", events.output, error={
                    "code": _error_code(error), "message": error.message})
                yield events.emit("response.failed", response=failed)
                return


class _EventWriter:
    """Numbers events and tracks the output items: at most one open message or reasoning
    item at a time."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        self._message_id: str | None = None  # the open message item
        self._text: list[str] = []
        self._reasoning_id: str | None = None  # the open reasoning item
        self._reasoning: list[str] = []

    def emit(self, kind: str, **fields: Any) -> str:
        event = sse_event({"type": kind, "sequence_number": self.sequence_number, **fields},
                          event=kind)
        self.sequence_number += 1
        return event

    def _open_message(self) -> list[str]:
        self._message_id, self._text = _item_id("msg"), []
        where = {"item_id": self._message_id, "output_index": len(self.output)}
        return [self.emit("response.output_item.added", output_index=len(self.output),
                          item=message_item(self._message_id, None, "in_progress")),
                self.emit("response.content_part.added", **where, content_index=0,
                          part=text_part(""))]

    def reasoning(self, delta: str) -> list[str]:
        events = []
        if self._reasoning_id is None:
            events = self.close_message()
            self._reasoning_id, self._reasoning = _item_id("rs"), []
            events.append(self.emit("response.output_item.added", output_index=len(self.output),
                                    item=reasoning_item(self._reasoning_id, "", "in_progress")))
        self._reasoning.append(delta)
        events.append(self.emit("response.reasoning_text.delta", item_id=self._reasoning_id,
                                output_index=len(self.output), content_index=0, delta=delta))
        return events

    def close_reasoning(self) -> list[str]:
        if self._reasoning_id is None:
            return []
        text, item_id, index = "".join(self._reasoning), self._reasoning_id, len(self.output)
        item = reasoning_item(item_id, text, "completed")
        self.output.append(item)
        self._reasoning_id = None
        return [self.emit("response.reasoning_text.done", item_id=item_id, output_index=index,
                          content_index=0, text=text),
                self.emit("response.output_item.done", output_index=index, item=item)]

    def text(self, delta: str) -> list[str]:
        events = self.close_reasoning()
        if self._message_id is None:
            events += self._open_message()
        self._text.append(delta)
        events.append(self.emit("response.output_text.delta", item_id=self._message_id,
                                output_index=len(self.output), content_index=0, delta=delta,
                                logprobs=[]))
        return events

    def close_message(self, status: str = "completed") -> list[str]:
        if self._message_id is None:
            return []
        text, item_id, index = "".join(self._text), self._message_id, len(self.output)
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        item = message_item(item_id, text, status)
        self.output.append(item)
        self._message_id = None
        return [self.emit("response.output_text.done", **where, text=text, logprobs=[]),
                self.emit("response.content_part.done", **where, part=text_part(text)),
                self.emit("response.output_item.done", output_index=index, item=item)]

    def function_call(self, call: ToolCall) -> list[str]:
        events = self.close_reasoning() + self.close_message()
        item_id, index = _item_id("fc"), len(self.output)
        where = {"item_id": item_id, "output_index": index}
        item = function_call_item(item_id, call)
        self.output.append(item)
        return events + [
            self.emit("response.output_item.added", output_index=index,
                      item=function_call_item(item_id, call, "in_progress")),
            self.emit("response.function_call_arguments.delta", **where, delta=call.arguments),
            self.emit("response.function_call_arguments.done", **where, name=call.name,
                      arguments=call.arguments),
            self.emit("response.output_item.done", output_index=index, item=item)]

    def finish(self, status: str) -> list[str]:
        """Close the open item; a reply with no output at all still gets an empty message."""
        events = self.close_reasoning()
        if self._message_id is None and not any(i["type"] != "reasoning" for i in self.output):
            return events + self._open_message() + self.close_message(status)
        return events + self.close_message(status)
