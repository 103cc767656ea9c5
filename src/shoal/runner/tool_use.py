"""A GenerationRequest's tools and response format, turned into engine terms: the prompt the
chat template renders, and the grammar (if any) the output must follow.

    response_format json_object            -> any JSON object
    response_format json_schema            -> JSON valid under that schema
    tool_choice "required" / a named tool  -> exactly one call, in the model's call format
    tool_choice "auto" with a JSON format  -> either one call or the JSON answer
    tool_choice "none"                     -> the tools are not offered at all
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shoal.engine.grammar_spec import GrammarSpec
from shoal.engine.sampling import InvalidParameter
from shoal.protocol import ForcedTool, GenerationRequest, ToolSpec
from shoal.runner.tool_format import (
    ToolCallFormat,
    call_grammar,
    closed_schema,
    format_for_template,
)
from shoal.runner.tool_prompt import (
    template_messages,
    template_tools,
    with_tool_section,
)

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class TemplateToolSupport:
    """What the model's chat template does with tools."""

    native: bool  # the template reads `tools` and renders tool turns itself
    call_format: ToolCallFormat

    @classmethod
    def of(cls, source: str, uses_tools: bool) -> TemplateToolSupport:
        return cls(native=uses_tools, call_format=format_for_template(source, uses_tools))


def offered_tools(request: GenerationRequest) -> tuple[ToolSpec, ...]:
    """The tools the model sees: none when tool_choice is "none"."""
    return () if request.tool_choice == "none" else request.tools


def check_tools(request: GenerationRequest) -> None:
    """InvalidParameter for tool settings no dialect should have let through."""
    names = [tool.name for tool in request.tools]
    if len(set(names)) != len(names):
        raise InvalidParameter("tools", "tool names must be unique")
    if any(not name for name in names):
        raise InvalidParameter("tools", "every tool needs a non-empty name")
    choice = request.tool_choice
    if choice == "required" and not request.tools:
        raise InvalidParameter("tool_choice", 'tool_choice "required" needs tools')
    if isinstance(choice, ForcedTool) and choice.name not in names:
        raise InvalidParameter("tool_choice", f"tool_choice names {choice.name!r}, which is "
                                              f"not one of the tools")


def grammar_param(request: GenerationRequest) -> str:
    """The request field a grammar error is about."""
    return "tools" if request.tool_choice != "auto" and offered_tools(request) \
        else "response_format"


def output_grammar(request: GenerationRequest, fmt: ToolCallFormat) -> GrammarSpec | None:
    """The grammar the output must follow, or None for free text."""
    answer = answer_schema(request)
    tools = offered_tools(request)
    choice = request.tool_choice
    if tools and isinstance(choice, ForcedTool):
        forced = tuple(tool for tool in tools if tool.name == choice.name)
        return GrammarSpec(lark=call_grammar(fmt, forced))
    if tools and choice == "required":
        return GrammarSpec(lark=call_grammar(fmt, tools))
    if tools and answer is not None:
        return GrammarSpec(lark=call_grammar(fmt, tools, answer_schema=answer))
    return GrammarSpec(json_schema=answer) if answer is not None else None


def answer_schema(request: GenerationRequest) -> dict[str, Any] | None:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return ANY_OBJECT
    if not isinstance(response_format.json_schema, dict):
        raise InvalidParameter("response_format", "a json_schema response format needs a "
                                                  "schema object")
    return closed_schema(response_format.json_schema)


def chat_prompt(request: GenerationRequest, support: TemplateToolSupport,
                render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]) -> str:
    """The rendered chat prompt, tools included the way the template can take them."""
    messages = template_messages(request.messages or (), support.native, support.call_format)
    tools = offered_tools(request)
    if not tools:
        return render(messages, None)
    if support.native:
        return render(messages, template_tools(tools))
    return render(with_tool_section(messages, tools, request.tool_choice, support.call_format),
                  None)
