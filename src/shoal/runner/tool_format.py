"""How a model family writes a tool call, and the grammar that makes it write exactly one.

The format follows the chat template: a template that mentions `<tool_call>` (Qwen, Hermes)
wraps a JSON object in those tags; one that mentions `[TOOL_CALLS]` (Mistral) writes that
marker and a JSON list; any other template that reads `tools` (Llama 3) expects a bare JSON
object with "parameters". Templates without tool support get the tagged format, described
to the model in a system message (see tool_prompt.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.engine.grammar_spec import JSON_STYLE
from shoal.protocol import ToolSpec


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    prefix: str  # written before the call's JSON
    suffix: str  # written after it
    arguments_key: str  # "arguments" or "parameters"
    as_list: bool = False  # the JSON is a list of call objects

    def render(self, calls: Sequence[tuple[str, Any]]) -> str:
        """Past calls (name, arguments object) as the model would have written them."""
        objects = [{"name": name, self.arguments_key: arguments} for name, arguments in calls]
        if self.as_list:
            return self.prefix + _dumps(objects) + self.suffix
        return "\n".join(self.prefix + _dumps(o) + self.suffix for o in objects)


TAGGED = ToolCallFormat("tagged", "<tool_call>\n", "\n</tool_call>", "arguments")
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]", "", "arguments", as_list=True)
BARE_JSON = ToolCallFormat("json", "", "", "parameters")


def format_for_template(source: str, uses_tools: bool) -> ToolCallFormat:
    if "<tool_call>" in source or not uses_tools:
        return TAGGED
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    return BARE_JSON


def arguments_schema(tool: ToolSpec) -> dict[str, Any]:
    """The tool's parameter schema, closed (see closed_schema); any object when empty."""
    return closed_schema(tool.parameters) if tool.parameters else {"type": "object"}


def call_schema(fmt: ToolCallFormat, tools: Sequence[ToolSpec]) -> dict[str, Any]:
    """JSON schema of one call to any of `tools`, name first, in this format's shape."""
    options = [{"type": "object",
                "properties": {"name": {"const": tool.name},
                               fmt.arguments_key: arguments_schema(tool)},
                "required": ["name", fmt.arguments_key],
                "additionalProperties": False} for tool in tools]
    call = options[0] if len(options) == 1 else {"anyOf": options}
    if fmt.as_list:
        return {"type": "array", "items": call, "minItems": 1, "maxItems": 1}
    return call


def call_grammar(fmt: ToolCallFormat, tools: Sequence[ToolSpec],
                 answer_schema: Mapping[str, Any] | None = None) -> str:
    """A Lark grammar (llguidance dialect) for exactly one call to one of `tools`, or, with
    answer_schema, for either such a call or a JSON answer valid under that schema."""
    call = _sequence(fmt.prefix, "call_json", fmt.suffix)
    lines = [f"call: {call}", f"call_json: {lark_json(call_schema(fmt, tools))}"]
    if answer_schema is None:
        lines.insert(0, "start: call")
    else:
        lines[:0] = ["start: call | answer", f"answer: {lark_json(answer_schema)}"]
    return "\n".join(lines)


def lark_json(schema: Mapping[str, Any]) -> str:
    """A `%json` rule body in the compact style the engine uses for plain schemas."""
    options = {**JSON_STYLE, **schema.get("x-guidance", {})}
    return "%json " + json.dumps({**schema, "x-guidance": options})


def closed_schema(schema: Any) -> Any:
    """The schema with "additionalProperties": false on every object that lists properties
    and says nothing about extra ones.

    Every output valid under the result is valid under the original; without it a small
    model keeps inventing keys until it runs out of tokens. allOf branches keep their
    default, since closing them would forbid each other's properties.
    """
    return _close(schema, close_here=True)


def _close(schema: Any, close_here: bool) -> Any:
    if isinstance(schema, list):
        return [_close(item, close_here) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties"):
            result[key] = ({name: _close(sub, True) for name, sub in value.items()}
                           if isinstance(value, dict) else value)
        elif key in ("items", "additionalProperties", "not", "prefixItems", "anyOf", "oneOf",
                     "contains", "if", "then", "else"):
            result[key] = _close(value, True)
        elif key == "allOf":
            result[key] = _close(value, False)
        else:
            result[key] = value
    if (close_here and "properties" in result and "additionalProperties" not in result
            and "patternProperties" not in result and "unevaluatedProperties" not in result):
        result["additionalProperties"] = False
    return result


def _sequence(prefix: str, rule: str, suffix: str) -> str:
    parts = [json.dumps(prefix)] if prefix else []
    parts.append(rule)
    if suffix:
        parts.append(json.dumps(suffix))
    return " ".join(parts)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
