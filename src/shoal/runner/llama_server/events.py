"""llama-server's streamed events as shoal's chunks.

One EventReader per request reads the JSON of each server-sent event, in order, and gives
the chunks it means: AcceptedChunk at the first prompt-progress event (its total is the
prompt's length), TokenChunk / ReasoningChunk per delta, a ToolCallChunk per complete call
at the end, then exactly one FinishChunk with usage. Chat events follow OpenAI's
chat.completion.chunk shape; native `/completion` events carry content, token ids and, in
the last, the stop type and counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.protocol import (
    AcceptedChunk,
    ErrorChunk,
    FinishChunk,
    ReasoningChunk,
    TokenChunk,
    ToolCall,
    ToolCallChunk,
    Usage,
)

_FINISH = {"stop": "stop", "eos": "stop", "word": "stop", "length": "length", "limit": "length",
           "tool_calls": "tool_calls"}


@dataclass
class _CallParts:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class EventReader:
    def __init__(self, request_id: str, chat: bool, model: str | None = None) -> None:
        self.request_id = request_id
        self.chat = chat
        self.model = model
        self.accepted = False
        self.finished = False
        self._finish_reason: str | None = None
        self._stop_sequence: str | None = None
        self._usage: Usage | None = None
        self._calls: dict[int, _CallParts] = {}

    def feed(self, event: dict[str, Any]) -> list[Any]:
        """The chunks one event means (possibly none)."""
        if "error" in event:
            return [error_chunk(self.request_id, event["error"])]
        chunks: list[Any] = []
        progress = event.get("prompt_progress")
        if not self.accepted and (progress is not None or not self.chat):
            total = progress["total"] if progress else int(event.get("tokens_evaluated", 0))
            chunks.append(self._accept(total))
        chunks += self._chat(event) if self.chat else self._native(event)
        return chunks

    def close(self) -> list[Any]:
        """At the stream's end: the finish of a reply that said how it finished but sent
        no usage; nothing otherwise (the reader stays unfinished when the reply broke off)."""
        if self.finished or self._finish_reason is None:
            return []
        return self._finish()

    def _accept(self, prompt_tokens: int) -> AcceptedChunk:
        self.accepted = True
        return AcceptedChunk(request_id=self.request_id, prompt_tokens=prompt_tokens,
                             model=self.model)

    # ---- /v1/chat/completions ---------------------------------------------------------------

    def _chat(self, event: dict[str, Any]) -> list[Any]:
        chunks: list[Any] = []
        if event.get("usage"):
            self._usage = _chat_usage(event["usage"])
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                chunks.append(ReasoningChunk(request_id=self.request_id,
                                             text=delta["reasoning_content"]))
            if delta.get("content"):
                chunks.append(TokenChunk(request_id=self.request_id, text=delta["content"],
                                         token_ids=()))
            for part in delta.get("tool_calls") or ():
                self._add_call_part(part)
            if choice.get("finish_reason"):
                self._finish_reason = _FINISH.get(choice["finish_reason"], "stop")
        # With include_usage the usage event comes last; without it, finishing is enough.
        if self._finish_reason is not None and self._usage is not None:
            chunks += self._finish()
        return chunks

    def _add_call_part(self, part: dict[str, Any]) -> None:
        call = self._calls.setdefault(int(part.get("index", 0)), _CallParts())
        call.id = part.get("id") or call.id
        function = part.get("function") or {}
        call.name += function.get("name") or ""
        call.arguments.append(function.get("arguments") or "")

    # ---- /completion -------------------------------------------------------------------------

    def _native(self, event: dict[str, Any]) -> list[Any]:
        chunks: list[Any] = []
        if event.get("content") or event.get("tokens"):
            chunks.append(TokenChunk(request_id=self.request_id, text=event.get("content", ""),
                                     token_ids=tuple(event.get("tokens") or ())))
        if event.get("stop"):
            self._finish_reason = _FINISH.get(event.get("stop_type", ""), "stop")
            self._stop_sequence = event.get("stopping_word") or None
            self._usage = Usage(prompt_tokens=int(event.get("tokens_evaluated", 0)),
                                completion_tokens=int(event.get("tokens_predicted", 0)),
                                cached_tokens=int(event.get("tokens_cached", 0)))
            chunks += self._finish()
        return chunks

    def _finish(self) -> list[Any]:
        self.finished = True
        chunks: list[Any] = [
            ToolCallChunk(request_id=self.request_id, index=index,
                          call=ToolCall(id=call.id or f"call_{index}", name=call.name,
                                        arguments="".join(call.arguments) or "{}"))
            for index, call in sorted(self._calls.items())]
        reason = self._finish_reason or "stop"
        if self._calls and reason == "stop":
            reason = "tool_calls"
        usage = self._usage or Usage(prompt_tokens=0, completion_tokens=0)
        chunks.append(FinishChunk(request_id=self.request_id, finish_reason=reason,
                                  usage=usage, stop_sequence=self._stop_sequence))
        return chunks


def _chat_usage(usage: dict[str, Any]) -> Usage:
    details = usage.get("prompt_tokens_details") or {}
    return Usage(prompt_tokens=int(usage.get("prompt_tokens", 0)),
                 completion_tokens=int(usage.get("completion_tokens", 0)),
                 cached_tokens=int(details.get("cached_tokens", 0)))


def error_chunk(request_id: str, error: Any, status: int | None = None) -> ErrorChunk:
    """llama-server's error body ({"code", "message", "type"}) as an ErrorChunk: its 400s
    are the client's (a prompt too long for the context among them), the rest the server's."""
    if not isinstance(error, dict):
        error = {"message": str(error)}
    message = f"llama-server: {error.get('message') or 'error'}"
    status = status or int(error.get("code") or 500)
    if error.get("type") == "exceed_context_size_error":
        return ErrorChunk(request_id=request_id, code="context_length_exceeded",
                          message=message)
    if status == 400:
        return ErrorChunk(request_id=request_id, code="invalid_request", message=message)
    if status == 503:
        return ErrorChunk(request_id=request_id, code="unavailable", message=message)
    return ErrorChunk(request_id=request_id, code="internal", message=message)
