"""OpenAI Responses request bodies (the subset shoal honours). Unknown fields are ignored, as
for chat completions; fields shoal cannot honour are rejected in the adapter."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from shoal.api.admission import AdmissionFields
from shoal.api.openai.schemas import OpenAIModel


class ContentPartIn(OpenAIModel):
    type: str  # input_text / output_text carry text, input_image an image; files and audio
    text: str | None = None  # are refused
    image_url: str | None = None  # input_image: a data URL (a file_id is refused)


class InputItem(OpenAIModel):
    """A message (role + content), a function_call, a function_call_output, or another item
    type the adapter refuses or skips."""

    type: str | None = None  # absent on the short message form {"role", "content"}
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPartIn] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPartIn] | None = None
    summary: list[ContentPartIn] | None = None  # reasoning items (content: reasoning_text)


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint for reasoning models; no effect here


class ToolIn(OpenAIModel):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceIn(OpenAIModel):
    type: str
    name: str | None = None


class ResponsesRequest(OpenAIModel, AdmissionFields):
    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[ToolIn] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None  # shoal keeps no responses; the reply says store: false
    previous_response_id: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None  # extra output data shoal does not produce
    metadata: dict[str, str] | None = None
    user: str | None = None
    keep_alive: float | str | None = None  # extension, as Ollama's: seconds or "5m"
