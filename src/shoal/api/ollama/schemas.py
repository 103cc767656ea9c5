"""Ollama request bodies. Unknown fields are ignored, as Ollama itself does; fields shoal
cannot honour are rejected in the adapter with a 400 naming them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shoal.api.admission import AdmissionFields


class OllamaModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCallIn(OllamaModel):
    name: str
    arguments: dict[str, Any] | str | None = None  # an object; JSON text is tolerated


class ToolCallIn(OllamaModel):
    id: str | None = None
    function: FunctionCallIn


class MessageIn(OllamaModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_name: str | None = None  # a tool turn: which function produced this result
    thinking: str | None = None  # an earlier reply's reasoning, shown again where the format does


class FunctionIn(OllamaModel):
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolIn(OllamaModel):
    type: str = "function"
    function: FunctionIn


class GenerationFields(OllamaModel, AdmissionFields):
    """Fields /api/chat and /api/generate share."""

    model: str = Field(min_length=1)
    stream: bool = True  # Ollama streams unless told not to
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None
    think: bool | str | None = None  # true / false, or "low" / "medium" / "high"
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatRequest(GenerationFields):
    messages: list[MessageIn] = Field(default_factory=list)
    tools: list[ToolIn] | None = None


class GenerateRequest(GenerationFields):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None


class ModelNameRequest(OllamaModel):
    """/api/show and /api/pull: older clients send "name", newer ones "model"."""

    model: str | None = None
    name: str | None = None
    stream: bool = True
    verbose: bool | None = None
    insecure: bool | None = None

    @property
    def model_name(self) -> str:
        return self.model or self.name or ""
