"""OpenAI chat fields for tools and structured output, to and from the internal request."""

from __future__ import annotations

from typing import Any

from shoal.api.errors import invalid_parameter
from shoal.api.openai.schemas import (
    ChatCompletionRequest,
    ChatMessageIn,
    ResponseFormatIn,
)
from shoal.api.tools import arguments_text, check_tool_named, tool_spec
from shoal.protocol import ForcedTool, ResponseFormat, ToolCall, ToolChoice, ToolSpec


def internal_tools(body: ChatCompletionRequest) -> tuple[ToolSpec, ...]:
    tools = tuple(tool_spec(tool.function.name, tool.function.description,
                            tool.function.parameters, f"tools.{n}.function.name")
                  for n, tool in enumerate(body.tools or ()))
    names = [tool.name for tool in tools]
    for n, name in enumerate(names):
        if name in names[:n]:
            raise invalid_parameter(f"tools.{n}.function.name",
                                    f"two tools are named {name!r}; names must be unique")
    return tools


def internal_tool_choice(body: ChatCompletionRequest, tools: tuple[ToolSpec, ...]) -> ToolChoice:
    """OpenAI's default is "auto" with tools and "none" without."""
    choice = body.tool_choice
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto"):
        return choice
    if not tools:
        raise invalid_parameter("tool_choice", "tool_choice other than none or auto needs "
                                               "tools")
    if choice == "required":
        return "required"
    check_tool_named(choice.function.name, tools, "tool_choice")
    return ForcedTool(name=choice.function.name)


def internal_response_format(raw: ResponseFormatIn | None) -> ResponseFormat | None:
    if raw is None or raw.type == "text":
        return None
    if raw.type == "json_object":
        return ResponseFormat(type="json_object")
    if raw.json_schema is None:
        raise invalid_parameter("response_format.json_schema",
                                'a "json_schema" response format needs json_schema')
    if raw.json_schema.schema_ is None:  # OpenAI makes the schema optional: any JSON object
        return ResponseFormat(type="json_object")
    return ResponseFormat(type="json_schema", json_schema=raw.json_schema.schema_)


def internal_tool_calls(message: ChatMessageIn, index: int) -> tuple[ToolCall, ...]:
    if message.tool_calls and message.role != "assistant":
        raise invalid_parameter(f"messages.{index}.tool_calls",
                                "only assistant messages carry tool_calls")
    return tuple(
        ToolCall(id=call.id, name=call.function.name,
                 arguments=arguments_text(call.function.arguments,
                                          f"messages.{index}.tool_calls.{n}.function.arguments"))
        for n, call in enumerate(message.tool_calls or ()))


def check_tool_call_id(message: ChatMessageIn, index: int) -> None:
    if message.role == "tool" and not message.tool_call_id:
        raise invalid_parameter(f"messages.{index}.tool_call_id",
                                "a tool message needs the tool_call_id it answers")


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta(index: int, call: ToolCall) -> dict[str, Any]:
    """A streamed call: the whole call in one delta (clients merge deltas by index)."""
    return {"tool_calls": [{"index": index, **tool_call_json(call)}]}
