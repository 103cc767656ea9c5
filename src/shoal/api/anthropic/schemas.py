"""Anthropic Messages request bodies. Unknown fields are ignored (newer clients send more);
fields and content blocks shoal cannot honour are rejected in the adapter with a 400."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shoal.api.admission import AdmissionFields


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageSource(AnthropicModel):
    type: str  # "base64" is taken; "url" and "file" are refused
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ContentBlock(AnthropicModel):
    """Any content block; the adapter checks which fields its type needs."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None  # tool_result
    is_error: bool | None = None  # tool_result
    thinking: str | None = None  # thinking (its signature is not checked: shoal signs none)
    source: ImageSource | None = None  # image


class MessageIn(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolIn(AnthropicModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; server tools have versioned types


class ToolChoiceIn(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormatIn(AnthropicModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfigIn(AnthropicModel):
    format: OutputFormatIn | None = None  # structured output: JSON valid under the schema
    effort: str | None = None


class PromptFields(AnthropicModel, AdmissionFields):
    """What count_tokens and messages share: everything that shapes the prompt."""

    model: str = Field(min_length=1)
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfigIn | None = None


class MessagesRequest(PromptFields):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # user_id: for the caller's records; no effect
    keep_alive: float | str | None = None  # extension, as Ollama's: seconds or "5m"


class CountTokensRequest(PromptFields):
    pass
