"""POST /v1/responses (OpenAI's Responses API): request bodies -> GenerationRequest.

input is a string or a list of items: messages (input_text / output_text parts, and
input_image data URLs for a model that takes images),
function_call and function_call_output items (a finished tool round trip), and reasoning
items of earlier turns (their reasoning_text, else their summary), which become the next
assistant turn's reasoning. reasoning.effort reaches reasoning models ("none": the reasoning
is not returned); their reasoning comes back as a reasoning item. shoal stores nothing, so
previous_response_id, item references and background runs are refused; send the whole
conversation in input instead.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from shoal.api.admission import admitted
from shoal.api.errors import invalid_parameter
from shoal.api.generation import respond
from shoal.api.image_input import image_from_url
from shoal.api.ollama.options import keep_alive_seconds
from shoal.api.reasoning import effort_request
from shoal.api.openai.responses_events import ResponsesResponder
from shoal.api.openai.responses_schemas import InputItem, ResponsesRequest, TextFormat
from shoal.api.sampling import build_sampling_params
from shoal.api.tools import arguments_text, check_tool_named, tool_spec
from shoal.protocol import (
    ChatMessage,
    ForcedTool,
    GenerationRequest,
    ImageInput,
    ReasoningRequest,
    ResponseFormat,
    ToolCall,
    ToolChoice,
    ToolSpec,
)

router = APIRouter()

_TEXT_PARTS = ("input_text", "output_text", "text")


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _part_content(content: Any, where: str) -> tuple[str, tuple[ImageInput, ...]]:
    """The text and the images (input_image parts, data URLs only) of content."""
    if content is None or isinstance(content, str):
        return content or "", ()
    parts, images = [], []
    for n, part in enumerate(content):
        if part.type == "input_image" and part.image_url is not None:
            images.append(image_from_url(part.image_url, f"{where}.{n}.image_url"))
        elif part.type in _TEXT_PARTS and part.text is not None:
            parts.append(part.text)
        else:
            raise invalid_parameter(f"{where}.{n}.type", f"content of type {part.type!r} is "
                                                         f"not supported")
    return "".join(parts), tuple(images)


def _part_text(content: Any, where: str) -> str:
    """Text alone (an assistant's message, a function's output): images are refused."""
    text, images = _part_content(content, where)
    if images:
        raise invalid_parameter(where, "only user, system and developer messages take images")
    return text


def _append_call(messages: list[ChatMessage], item: InputItem, where: str) -> None:
    """A function_call item joins the assistant turn just before it, or starts one."""
    if not item.call_id or not item.name:
        raise invalid_parameter(where, "function_call items need call_id and name")
    call = ToolCall(id=item.call_id, name=item.name,
                    arguments=arguments_text(item.arguments, f"{where}.arguments"))
    if messages and messages[-1].role == "assistant":
        last = messages.pop()
        messages.append(last.model_copy(update={"tool_calls": (*last.tool_calls, call)}))
    else:
        messages.append(ChatMessage(role="assistant", content="", tool_calls=(call,)))


def _reasoning_text(item: InputItem) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary."""
    parts = item.content if isinstance(item.content, list) else []
    text = "".join(p.text or "" for p in parts if p.type == "reasoning_text")
    return text or "\n".join(p.text or "" for p in item.summary or ())


def _append_assistant_text(messages: list[ChatMessage], text: str) -> None:
    """An assistant message joins the reasoning-only turn just before it, or starts one."""
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant" and not last.content \
            and not last.tool_calls:
        messages[-1] = last.model_copy(update={"content": text})
    else:
        messages.append(ChatMessage(role="assistant", content=text))


def chat_messages(body: ResponsesRequest) -> tuple[ChatMessage, ...]:
    messages = [ChatMessage(role="system", content=body.instructions)] \
        if body.instructions else []
    if isinstance(body.input, str):
        return (*messages, ChatMessage(role="user", content=body.input))
    for i, item in enumerate(body.input):
        where = f"input.{i}"
        kind = item.type or "message"
        if kind == "message":
            if item.role is None:
                raise invalid_parameter(f"{where}.role", "message items need a role")
            # "developer" instructions are what chat templates call the system turn
            role = "system" if item.role == "developer" else item.role
            if role == "assistant":
                _append_assistant_text(messages, _part_text(item.content, f"{where}.content"))
            else:
                text, images = _part_content(item.content, f"{where}.content")
                messages.append(ChatMessage(role=role, content=text, images=images))
        elif kind == "reasoning":
            reasoning = _reasoning_text(item)
            if reasoning:
                messages.append(ChatMessage(role="assistant", content="", reasoning=reasoning))
        elif kind == "function_call":
            _append_call(messages, item, where)
        elif kind == "function_call_output":
            if not item.call_id:
                raise invalid_parameter(f"{where}.call_id", "function_call_output needs "
                                                            "call_id")
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=_part_text(item.output, f"{where}.output")))
        else:
            raise invalid_parameter(f"{where}.type", f"input items of type {kind!r} are not "
                                                     f"supported")
    if not messages:
        raise invalid_parameter("input", "input must hold at least one message")
    return tuple(messages)


def _tools(body: ResponsesRequest) -> tuple[ToolSpec, ...]:
    specs = []
    for n, tool in enumerate(body.tools or ()):
        if tool.type != "function":
            raise invalid_parameter(f"tools.{n}.type", f"tools of type {tool.type!r} are not "
                                                       f"supported; use function tools")
        specs.append(tool_spec(tool.name or "", tool.description, tool.parameters,
                               f"tools.{n}.name"))
    return tuple(specs)


def _tool_choice(body: ResponsesRequest, tools: tuple[ToolSpec, ...]) -> ToolChoice:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice or "auto"
    if choice.type != "function" or not choice.name:
        raise invalid_parameter("tool_choice", 'tool_choice must be "auto", "none", '
                                               '"required" or a function by name')
    check_tool_named(choice.name, tools, "tool_choice.name")
    return ForcedTool(name=choice.name)


def response_format(text_format: TextFormat | None) -> ResponseFormat | None:
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return ResponseFormat(type="json_object")
    if text_format.json_schema is None:
        raise invalid_parameter("text.format.schema", "a json_schema format needs a schema")
    return ResponseFormat(type="json_schema", json_schema=text_format.json_schema)


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.previous_response_id:
        raise invalid_parameter("previous_response_id", "shoal does not store responses; "
                                                        "send the whole conversation in input")
    if body.background:
        raise invalid_parameter("background", "background responses are not supported")
    if body.truncation == "auto":
        raise invalid_parameter("truncation", 'only truncation "disabled" is supported')
    if body.top_logprobs:
        raise invalid_parameter("top_logprobs", "top_logprobs is not supported on "
                                                "/v1/responses; use /v1/chat/completions")


def _reasoning(body: ResponsesRequest) -> ReasoningRequest | None:
    effort = (body.reasoning or {}).get("effort")
    if effort == "none":
        return ReasoningRequest(enabled=False, param="reasoning.effort")
    return effort_request(effort, "reasoning.effort")


def to_internal(body: ResponsesRequest, request_id: str) -> GenerationRequest:
    _refuse_unsupported(body)
    tools = _tools(body)
    sampling = build_sampling_params(
        {"max_tokens": body.max_output_tokens, "temperature": body.temperature,
         "top_p": body.top_p}, {"max_tokens": "max_output_tokens"})
    return GenerationRequest(
        request_id=request_id, model=body.model, messages=chat_messages(body),
        sampling=sampling, stream=body.stream, tools=tools,
        tool_choice=_tool_choice(body, tools),
        response_format=response_format(body.text.format if body.text else None),
        reasoning=_reasoning(body), keep_alive_s=keep_alive_seconds(body.keep_alive))


def request_echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request settings a response object repeats back."""
    text_format = body.text.format if body.text and body.text.format else None
    return {
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls
        is not False, "previous_response_id": None,
        "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
        "store": False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True)
                 if text_format else {"type": "text"}},
        "tool_choice": body.tool_choice.model_dump(exclude_none=True)
        if body.tool_choice is not None and not isinstance(body.tool_choice, str)
        else (body.tool_choice or "auto"),
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
        "user": body.user,
    }


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = request.app.state
    internal = admitted(to_internal(body, new_response_id()), request, body)
    responder = ResponsesResponder(response_id=internal.request_id, model=body.model,
                                   echo=request_echo(body))
    return await respond(request, state.router, internal, responder, state.keepalive_s)
