"""Chat messages and tools, shaped for the model's own chat template.

A template that reads `tools` gets them in the Hugging Face shape, and tool calls and tool
results as structured messages. A template without tool support gets a system-message
section that lists the tools and the exact call format, past calls written out in that
format, and tool results as user turns wrapped in <tool_response> tags.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from shoal.protocol import ChatMessage, ForcedTool, ToolCall, ToolChoice, ToolSpec
from shoal.runner.tool_format import ToolCallFormat


def template_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """Tools as HF chat templates expect them."""
    return [{"type": "function",
             "function": {"name": t.name, "description": t.description,
                          "parameters": t.parameters or {"type": "object", "properties": {}}}}
            for t in tools]


def template_messages(messages: Sequence[ChatMessage], native: bool,
                      fmt: ToolCallFormat) -> list[dict[str, Any]]:
    """Messages as dicts for the template; native: the template understands tool turns."""
    call_names = {call.id: call.name for m in messages for call in m.tool_calls}
    shaped: list[dict[str, Any]] = []
    previous_role = None
    for message in messages:
        if native:
            shaped.append(_native_message(message, call_names))
        elif message.role == "tool":
            _append_tool_result(shaped, message, merge=previous_role == "tool")
        else:
            shaped.append(_plain_message(message, fmt))
        previous_role = message.role
    return shaped


def with_tool_section(messages: list[dict[str, Any]], tools: Sequence[ToolSpec],
                      tool_choice: ToolChoice, fmt: ToolCallFormat) -> list[dict[str, Any]]:
    """messages with the tools described at the end of the system message (added first
    when there is none)."""
    section = tool_section(tools, tool_choice, fmt)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content'].rstrip()}\n\n{section}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]


def tool_section(tools: Sequence[ToolSpec], tool_choice: ToolChoice,
                 fmt: ToolCallFormat) -> str:
    listing = "\n".join(json.dumps({"name": t.name, "description": t.description,
                                    "parameters": t.parameters}, ensure_ascii=False)
                        for t in tools)
    example = fmt.render([("<function name>", {"<argument>": "<value>"})])
    if isinstance(tool_choice, ForcedTool):
        rule = f"You must call the function {tool_choice.name} now."
    elif tool_choice == "required":
        rule = "You must call one of these functions now."
    else:
        rule = "Call a function only when it helps; otherwise answer normally."
    return (f"You can call these functions (name, description, JSON schema of the "
            f"arguments):\n{listing}\n\nTo call a function, reply with exactly this and "
            f"nothing else:\n{example}\n{rule}")


def _native_message(message: ChatMessage, call_names: dict[str, str]) -> dict[str, Any]:
    shaped = _base(message)
    if message.tool_calls:
        shaped["tool_calls"] = [{"id": call.id, "type": "function",
                                 "function": {"name": call.name,
                                              "arguments": _arguments(call)}}
                                for call in message.tool_calls]
    if message.tool_call_id is not None:
        shaped["tool_call_id"] = message.tool_call_id
        if "name" not in shaped and message.tool_call_id in call_names:
            shaped["name"] = call_names[message.tool_call_id]  # some templates print it
    return shaped


def _plain_message(message: ChatMessage, fmt: ToolCallFormat) -> dict[str, Any]:
    shaped = _base(message)
    if message.tool_calls:
        calls = fmt.render([(call.name, _arguments(call)) for call in message.tool_calls])
        shaped["content"] = f"{message.content}\n{calls}" if message.content else calls
    return shaped


def _append_tool_result(shaped: list[dict[str, Any]], message: ChatMessage,
                        merge: bool) -> None:
    """A tool result as a user turn; consecutive results (merge) share one turn."""
    wrapped = f"<tool_response>\n{message.content}\n</tool_response>"
    if merge:
        shaped[-1] = {**shaped[-1], "content": f"{shaped[-1]['content']}\n{wrapped}"}
    else:
        shaped.append({"role": "user", "content": wrapped})


def _base(message: ChatMessage) -> dict[str, Any]:
    shaped: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name is not None:
        shaped["name"] = message.name
    if message.reasoning is not None:  # templates of reasoning models read it (Qwen3)
        shaped["reasoning_content"] = message.reasoning
    return shaped


def _arguments(call: ToolCall) -> Any:
    """The arguments as an object (templates serialise them with tojson); text that is not
    JSON stays text."""
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments
