"""A conversation rendered in OpenAI's harmony chat format (gpt-oss), for a model whose
file carries no chat template of its own.

    <|start|>system<|message|>{identity, dates, "Reasoning: high", channels}<|end|>
    <|start|>developer<|message|># Instructions ... # Tools ... namespace functions {...}<|end|>
    <|start|>user<|message|>...<|end|>
    <|start|>assistant<|channel|>analysis<|message|>{reasoning}<|end|>
    <|start|>assistant<|channel|>commentary to=functions.X <|constrain|>json<|message|>{..}<|call|>
    <|start|>functions.X to=assistant<|channel|>commentary<|message|>{result}<|end|>
    <|start|>assistant<|channel|>final<|message|>{answer}<|end|>
    <|start|>assistant                                   (where the reply begins)

Earlier reasoning is dropped once a turn ended in a final answer; reasoning after the last
answer (a tool-calling loop still under way) is kept, as the format asks. Tools are
described as TypeScript-like types (schema_type).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import date
from typing import Any

from shoal.protocol import ChatMessage, ReasoningEffort, ToolSpec

IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
DEFAULT_EFFORT: ReasoningEffort = "medium"
GENERATION_PROMPT = "<|start|>assistant"


def render_harmony(messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = (),
                   effort: ReasoningEffort | None = None, today: date | None = None) -> str:
    """The prompt text for messages, ending where the assistant's reply begins."""
    leading = 0
    while leading < len(messages) and messages[leading].role in ("system", "developer"):
        leading += 1
    instructions = "\n\n".join(m.content for m in messages[:leading] if m.content)
    parts = [_message("system", system_text(effort or DEFAULT_EFFORT, bool(tools), today))]
    developer = developer_text(instructions, tools)
    if developer:
        parts.append(_message("developer", developer))
    rest = messages[leading:]
    call_names = {call.id: call.name for m in rest for call in m.tool_calls}
    last_answer = max((i for i, m in enumerate(rest) if m.role == "assistant"
                       and not m.tool_calls), default=-1)
    for index, message in enumerate(rest):
        if message.role == "assistant":
            parts.append(_assistant(message, keep_reasoning=index > last_answer))
        elif message.role == "tool":
            name = message.name or call_names.get(message.tool_call_id or "", "tool")
            parts.append(f"<|start|>functions.{name} to=assistant<|channel|>commentary"
                         f"<|message|>{message.content}<|end|>")
        elif message.role in ("system", "developer"):
            parts.append(_message("developer", f"# Instructions\n\n{message.content}"))
        else:
            parts.append(_message("user", message.content))
    return "".join(parts) + GENERATION_PROMPT


def system_text(effort: ReasoningEffort, has_tools: bool, today: date | None = None) -> str:
    text = (f"{IDENTITY}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\n"
            f"Current date: {(today or date.today()).isoformat()}\n\n"
            f"Reasoning: {effort}\n\n"
            "# Valid channels: analysis, commentary, final. "
            "Channel must be included for every message.")
    if has_tools:
        text += "\nCalls to these tools must go to the commentary channel: 'functions'."
    return text


def developer_text(instructions: str, tools: Sequence[ToolSpec]) -> str:
    sections = [f"# Instructions\n\n{instructions}"] if instructions else []
    if tools:
        functions = "".join(_function(tool) + "\n\n" for tool in tools)
        sections.append(f"# Tools\n\n## functions\n\nnamespace functions {{\n\n{functions}"
                        "} // namespace functions")
    return "\n\n".join(sections)


def _function(tool: ToolSpec) -> str:
    comment = f"// {tool.description}\n" if tool.description else ""
    properties = tool.parameters.get("properties")
    if not properties:
        return f"{comment}type {tool.name} = () => any;"
    return f"{comment}type {tool.name} = (_: {_object_body(tool.parameters)}) => any;"


def _object_body(schema: dict[str, Any]) -> str:
    """{ one line per property, its description as a comment above it }"""
    required = set(schema.get("required", ()))
    lines = ["{"]
    for name, spec in schema.get("properties", {}).items():
        spec = spec if isinstance(spec, dict) else {}
        if spec.get("description"):
            lines.append(f"// {spec['description']}")
        optional = "" if name in required else "?"
        default = (f" // default: {_default_text(spec['default'])}"
                   if "default" in spec else "")
        lines.append(f"{name}{optional}: {schema_type(spec)},{default}")
    lines.append("}")
    return "\n".join(lines)


def schema_type(schema: Any) -> str:
    """A JSON schema as the TypeScript-like type harmony describes arguments with."""
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return " | ".join(json.dumps(value) for value in schema["enum"]) or "any"
    if "const" in schema:
        return json.dumps(schema["const"])
    for union in ("anyOf", "oneOf"):
        if isinstance(schema.get(union), list):
            return " | ".join(schema_type(option) for option in schema[union]) or "any"
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(schema_type({**schema, "type": k}) for k in kind) or "any"
    if kind == "string":
        return "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "null":
        return "null"
    if kind == "array":
        item = schema_type(schema.get("items"))
        return f"{item}[]" if item.isidentifier() else f"Array<{item}>"
    if kind == "object" or "properties" in schema:
        return _object_body(schema) if schema.get("properties") else "object"
    return "any"


def _default_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _assistant(message: ChatMessage, keep_reasoning: bool) -> str:
    parts = []
    if keep_reasoning and message.reasoning:
        parts.append(_assistant_message("analysis", message.reasoning))
    if message.tool_calls:
        if message.content:  # a preamble shown to the user before the calls
            parts.append(_assistant_message("commentary", message.content))
        parts.extend(f"<|start|>assistant<|channel|>commentary to=functions.{call.name} "
                     f"<|constrain|>json<|message|>{call.arguments}<|call|>"
                     for call in message.tool_calls)
    else:
        parts.append(_assistant_message("final", message.content))
    return "".join(parts)


def _assistant_message(channel: str, content: str) -> str:
    return f"<|start|>assistant<|channel|>{channel}<|message|>{content}<|end|>"


def _message(role: str, content: str) -> str:
    return f"<|start|>{role}<|message|>{content}<|end|>"
