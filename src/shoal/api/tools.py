"""Tool-call pieces every dialect needs: specs in, calls out, call ids and argument objects."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from shoal.api.errors import APIError, invalid_parameter
from shoal.protocol import ToolCall, ToolSpec


def new_call_id(prefix: str = "call") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def tool_spec(name: str, description: str | None, parameters: dict[str, Any] | None,
              param: str) -> ToolSpec:
    """One function tool; param names the field in the client's request for errors."""
    if not name:
        raise invalid_parameter(param, "every tool needs a non-empty name")
    return ToolSpec(name=name, description=description or "", parameters=parameters or {})


def check_tool_named(name: str, tools: tuple[ToolSpec, ...], param: str) -> None:
    """A forced tool choice must name one of the request's tools."""
    if name not in {tool.name for tool in tools}:
        raise invalid_parameter(param, f"tool_choice names {name!r}, which is not in tools")


def arguments_text(arguments: str | dict[str, Any] | None, param: str) -> str:
    """A past call's arguments, given as an object or as JSON text, as JSON text."""
    if arguments is None:
        return "{}"
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    try:
        json.loads(arguments)
    except ValueError:
        raise invalid_parameter(param, "tool call arguments must be JSON") from None
    return arguments


def arguments_object(call: ToolCall) -> dict[str, Any]:
    """The call's arguments as an object (Ollama and Anthropic send objects, not JSON text)."""
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        # The tool-call parser promises a JSON object; anything else is a bug, said plainly.
        raise APIError(500, f"the model's call to {call.name!r} has arguments that are not a "
                            f"JSON object", code="internal", error_type="internal_error")
    return arguments


async def limit_tool_calls(chunks: AsyncIterator[Any], allow_parallel: bool
                           ) -> AsyncIterator[Any]:
    """chunks, keeping only the first tool call when the client asked for at most one."""
    seen = 0
    async for chunk in chunks:
        if chunk.kind == "tool_call":
            seen += 1
            if seen > 1 and not allow_parallel:
                continue
        yield chunk
