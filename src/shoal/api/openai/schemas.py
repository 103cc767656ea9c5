"""OpenAI request bodies (the subset shoal honours). Unknown fields are ignored, as OpenAI's
own servers tolerate newer clients; fields shoal cannot honour are rejected in the adapter."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shoal.api.admission import AdmissionFields


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class ImageURL(OpenAIModel):
    url: str
    detail: str | None = None  # the projector sees the image at its own size either way


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None  # type "image_url": a data URL


class FunctionCallIn(OpenAIModel):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] | None = None  # JSON text (some clients send an object)


class ToolCallIn(OpenAIModel):
    """A call an earlier assistant turn made."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(OpenAIModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers
    # An assistant turn's reasoning sent back (vLLM's and DeepSeek's name; "reasoning" too)
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None takes no arguments
    strict: bool | None = None  # shoal always enforces the schema when it constrains a call


class ToolIn(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIModel):
    name: str = Field(min_length=1)


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: FunctionName


class JSONSchemaFormat(OpenAIModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # shoal enforces the schema either way


class ResponseFormatIn(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(OpenAIModel, AdmissionFields):
    """Fields shared by chat and text completions."""

    model: str = Field(min_length=1)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    keep_alive: float | str | None = None  # extension, as Ollama's: seconds or "5m"


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormatIn | None = None
    reasoning_effort: Any = None  # "low" | "medium" | "high", checked in the adapter

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _one_tool_choice(cls, value: Any, handler: Any) -> Any:
        # One plain message: a union's error would name its members in the parameter path.
        try:
            return handler(value)
        except ValidationError:
            raise ValueError('tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}') from None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
