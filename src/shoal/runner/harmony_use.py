"""A chat request for a harmony model (gpt-oss), in engine terms: its prompt, the header
written for the model when the reply is forced, and the grammar of what follows.

The prompt is the file's own chat template when it carries one (gpt-oss files carry a
harmony template that reads reasoning_effort and tools), shoal's renderer
(harmony_render.py) otherwise. A forced call (a named tool_choice, or "required" with one
tool) or a JSON answer (response_format) is written into the prompt as the reply's first
header, so the model writes only the arguments or the answer, under that grammar:

    tool_choice {"name": X}  -> <|channel|>commentary to=functions.X <|constrain|>json<|message|>
    response_format          -> <|channel|>final<|message|>
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.engine.grammar_spec import GrammarSpec
from shoal.engine.sampling import InvalidParameter
from shoal.protocol import ChatMessage, ForcedTool, GenerationRequest
from shoal.runner.harmony_parser import MESSAGE
from shoal.runner.harmony_render import DEFAULT_EFFORT, render_harmony
from shoal.runner.tool_format import BARE_JSON, arguments_schema
from shoal.runner.tool_prompt import template_messages, template_tools
from shoal.runner.tool_use import answer_schema, offered_tools

Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]], str]


@dataclass(frozen=True)
class ForcedReply:
    header: str  # the reply's first header, written into the prompt before <|message|>
    grammar: GrammarSpec  # what the model writes as that message's content


def forced_reply(request: GenerationRequest) -> ForcedReply | None:
    """The header and grammar a forced call or a JSON answer needs; None for a free reply."""
    tools = offered_tools(request)
    choice = request.tool_choice
    if choice == "required" and len(tools) > 1:
        raise InvalidParameter("tool_choice", 'tool_choice "required" with several tools is '
                                              "not supported for harmony models (gpt-oss); "
                                              "name the tool to call")
    if choice == "required" and tools:
        choice = ForcedTool(name=tools[0].name)
    if isinstance(choice, ForcedTool) and tools:
        tool = next(tool for tool in tools if tool.name == choice.name)
        return ForcedReply(f"<|channel|>commentary to=functions.{tool.name} <|constrain|>json",
                           GrammarSpec(json_schema=arguments_schema(tool)))
    answer = answer_schema(request)
    if answer is None:
        return None
    if tools:
        raise InvalidParameter("response_format", "a response_format together with tools is "
                                                  "not supported for harmony models (gpt-oss)")
    return ForcedReply("<|channel|>final", GrammarSpec(json_schema=answer))


def harmony_prompt(request: GenerationRequest, template: Render | None) -> str:
    """The prompt text: the chat template's (template given) or shoal's rendering, then
    the forced reply's header if there is one."""
    effort = request.reasoning.effort if request.reasoning is not None else None
    messages = request.messages or ()
    tools = offered_tools(request)
    if template is None:
        text = render_harmony(messages, tools, effort)
    else:
        shaped = template_messages(_one_call_each(messages), True, BARE_JSON)  # native
        for message, original in zip(shaped, _one_call_each(messages), strict=True):
            _with_thinking(message, original)
        text = template(shaped, template_tools(tools) if tools else None,
                        {"reasoning_effort": effort or DEFAULT_EFFORT})
    forced = forced_reply(request)
    return text if forced is None else text + forced.header + MESSAGE


def _one_call_each(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """Assistant turns with several calls as one turn per call (the first keeps the text and
    reasoning): gpt-oss templates render only a turn's first call, since harmony writes one
    call per reply."""
    result: list[ChatMessage] = []
    for message in messages:
        if len(message.tool_calls) < 2:
            result.append(message)
            continue
        first, *rest = message.tool_calls
        result.append(message.model_copy(update={"tool_calls": (first,)}))
        result.extend(ChatMessage(role="assistant", content="", tool_calls=(call,))
                      for call in rest)
    return result


def _with_thinking(shaped: dict[str, Any], message: ChatMessage) -> None:
    """The reasoning of an assistant turn where gpt-oss templates read it ("thinking").
    Those templates take a call's analysis from content or thinking, never both."""
    if message.role != "assistant" or not message.reasoning:
        return
    shaped["thinking"] = message.reasoning
    if message.tool_calls:
        shaped["content"] = ""

