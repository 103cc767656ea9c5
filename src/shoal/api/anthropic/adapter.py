"""Anthropic Messages bodies -> GenerationRequest.

Content blocks: text everywhere; tool_use in assistant turns becomes the turn's tool calls;
tool_result in user turns becomes tool messages (before the turn's text, as Anthropic
requires them first); thinking blocks of earlier assistant turns become the turn's reasoning,
which the model's chat format shows again or leaves out (redacted_thinking is left out).
Images and documents are refused: shoal serves text models.

thinking {"type": "enabled", "budget_tokens": N} asks a reasoning model to reason and return
it: the budget picks the effort (under 4,096 low, under 16,384 medium, else high) unless
output_config.effort names one. Without it the reasoning is not returned.
"""

from __future__ import annotations

import json
import uuid

from shoal.api.anthropic.schemas import (
    ContentBlock,
    MessageIn,
    MessagesRequest,
    PromptFields,
    ToolChoiceIn,
)
from shoal.api.errors import invalid_parameter
from shoal.api.image_input import image_from_base64
from shoal.api.reasoning import effort_request
from shoal.api.ollama.options import keep_alive_seconds
from shoal.api.sampling import build_sampling_params
from shoal.api.tools import check_tool_named, tool_spec
from shoal.engine.sampling import SamplingParams
from shoal.protocol import (
    ChatMessage,
    ForcedTool,
    GenerationRequest,
    ImageInput,
    ReasoningEffort,
    ReasoningRequest,
    ResponseFormat,
    ToolCall,
    ToolChoice,
    ToolSpec,
)

# SamplingParams field -> Anthropic's name, for error messages.
PARAM_NAMES = {"max_tokens": "max_tokens", "stop": "stop_sequences"}
# budget_tokens below each bound -> that effort; at or above the last -> "high".
_EFFORT_BY_BUDGET: tuple[tuple[int, ReasoningEffort], ...] = ((4096, "low"), (16384, "medium"))
MIN_THINKING_BUDGET = 1024  # Anthropic's own minimum


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _text(blocks: str | list[ContentBlock] | None, where: str) -> str:
    """The text of a string or of text blocks; any other block is refused."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    parts = []
    for n, block in enumerate(blocks):
        if block.type != "text" or block.text is None:
            raise _unsupported_block(block, f"{where}.{n}")
        parts.append(block.text)
    return "".join(parts)


def _unsupported_block(block: ContentBlock, where: str):
    if block.type == "document":
        return invalid_parameter(f"{where}.type", "document blocks are not supported")
    return invalid_parameter(f"{where}.type", f"content blocks of type {block.type!r} are "
                                              f"not supported here")


def _user_turn(message: MessageIn, where: str) -> list[ChatMessage]:
    if isinstance(message.content, str):
        return [ChatMessage(role="user", content=message.content)]
    results, text, images = [], [], []
    for n, block in enumerate(message.content):
        if block.type == "tool_result":
            if not block.tool_use_id:
                raise invalid_parameter(f"{where}.{n}.tool_use_id", "tool_result needs "
                                                                    "tool_use_id")
            content = _text(block.content, f"{where}.{n}.content")
            if block.is_error:  # templates have no error flag; say it in the text
                content = f"Error: {content}"
            results.append(ChatMessage(role="tool", content=content,
                                       tool_call_id=block.tool_use_id))
        elif block.type == "text" and block.text is not None:
            text.append(block.text)
        elif block.type == "image":
            images.append(_image(block, f"{where}.{n}.source"))
        else:
            raise _unsupported_block(block, f"{where}.{n}")
    turn = [ChatMessage(role="user", content="".join(text), images=tuple(images))] \
        if text or images or not results else []
    return results + turn


def _image(block: ContentBlock, where: str) -> ImageInput:
    """An image block's base64 source; a URL or file source is refused (never fetched)."""
    source = block.source
    if source is None or source.type != "base64" or source.data is None:
        raise invalid_parameter(where, "only base64 image sources are taken; shoal does not "
                                       "fetch images from URLs or files")
    return image_from_base64(source.data, f"{where}.data")


def _assistant_turn(message: MessageIn, where: str) -> ChatMessage:
    if isinstance(message.content, str):
        return ChatMessage(role="assistant", content=message.content)
    text, calls, thinking = [], [], []
    for n, block in enumerate(message.content):
        if block.type == "text" and block.text is not None:
            text.append(block.text)
        elif block.type == "thinking":
            thinking.append(block.thinking or "")
        elif block.type == "tool_use":
            if not block.id or not block.name:
                raise invalid_parameter(f"{where}.{n}", "tool_use needs id and name")
            calls.append(ToolCall(id=block.id, name=block.name,
                                  arguments=json.dumps(block.input or {}, ensure_ascii=False)))
        elif block.type != "redacted_thinking":
            raise _unsupported_block(block, f"{where}.{n}")
    return ChatMessage(role="assistant", content="".join(text), tool_calls=tuple(calls),
                       reasoning="".join(thinking) or None)


def chat_messages(body: PromptFields) -> tuple[ChatMessage, ...]:
    messages = []
    if body.system:
        messages.append(ChatMessage(role="system", content=_text(body.system, "system")))
    for i, message in enumerate(body.messages):
        where = f"messages.{i}.content"
        if message.role == "user":
            messages.extend(_user_turn(message, where))
        else:
            messages.append(_assistant_turn(message, where))
    return tuple(messages)


def _tools(body: PromptFields) -> tuple[ToolSpec, ...]:
    specs = []
    for n, tool in enumerate(body.tools or ()):
        if tool.type not in (None, "custom"):
            raise invalid_parameter(f"tools.{n}.type", f"server tool {tool.type!r} is not "
                                                       f"supported; define a custom tool")
        specs.append(tool_spec(tool.name, tool.description, tool.input_schema,
                               f"tools.{n}.name"))
    return tuple(specs)


def _tool_choice(choice: ToolChoiceIn | None, tools: tuple[ToolSpec, ...]) -> ToolChoice:
    if choice is None or choice.type == "auto":
        return "auto"
    if choice.type == "any":
        return "required"
    if choice.type == "none":
        return "none"
    if not choice.name:
        raise invalid_parameter("tool_choice.name", 'tool_choice of type "tool" needs a name')
    check_tool_named(choice.name, tools, "tool_choice.name")
    return ForcedTool(name=choice.name)


def allows_parallel_tool_use(body: PromptFields) -> bool:
    return not (body.tool_choice and body.tool_choice.disable_parallel_tool_use)


def _sampling(body: MessagesRequest) -> SamplingParams:
    if body.temperature is not None and not 0.0 <= body.temperature <= 1.0:
        raise invalid_parameter("temperature", "temperature must be between 0 and 1")
    return build_sampling_params(
        {"max_tokens": body.max_tokens, "stop": tuple(body.stop_sequences or ()),
         "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k},
        PARAM_NAMES)


def _response_format(body: PromptFields) -> ResponseFormat | None:
    config = body.output_config
    if config is None:
        return None
    if config.format is None:
        return None
    return ResponseFormat(type="json_schema", json_schema=config.format.json_schema)


def _reasoning(body: PromptFields) -> ReasoningRequest:
    """Whether to return reasoning (thinking enabled) and how hard to reason."""
    effort_field = body.output_config.effort if body.output_config else None
    asked = effort_request(effort_field, "output_config.effort")
    thinking = body.thinking or {"type": "disabled"}
    kind = thinking.get("type")
    if kind == "disabled":
        return ReasoningRequest(enabled=False, effort=asked.effort if asked else None,
                                param="output_config.effort")
    if kind not in ("enabled", "adaptive"):
        raise invalid_parameter("thinking.type", 'thinking.type must be "enabled", '
                                                 '"adaptive" or "disabled"')
    effort = asked.effort if asked else None
    budget = thinking.get("budget_tokens")
    if kind == "enabled":
        max_tokens = getattr(body, "max_tokens", None)
        if not isinstance(budget, int) or isinstance(budget, bool) \
                or budget < MIN_THINKING_BUDGET:
            raise invalid_parameter("thinking.budget_tokens", f"thinking.budget_tokens must "
                                    f"be an integer of at least {MIN_THINKING_BUDGET}")
        if max_tokens is not None and budget >= max_tokens:
            raise invalid_parameter("thinking.budget_tokens", "thinking.budget_tokens must "
                                                              "be less than max_tokens")
        effort = effort or next((e for bound, e in _EFFORT_BY_BUDGET if budget < bound),
                                "high")
    return ReasoningRequest(enabled=True, effort=effort, param="thinking")


def to_internal(body: PromptFields, request_id: str) -> GenerationRequest:
    """The request for a Messages body, or for a count_tokens body (count_only)."""
    tools = _tools(body)
    common = {"request_id": request_id, "model": body.model, "messages": chat_messages(body),
              "tools": tools, "tool_choice": _tool_choice(body.tool_choice, tools),
              "response_format": _response_format(body), "reasoning": _reasoning(body)}
    if isinstance(body, MessagesRequest):
        return GenerationRequest(sampling=_sampling(body), stream=body.stream,
                                 keep_alive_s=keep_alive_seconds(body.keep_alive), **common)
    return GenerationRequest(count_only=True, **common)
