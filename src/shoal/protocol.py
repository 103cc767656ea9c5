"""Wire types shared by the API, the router and the runner.

A GenerationRequest goes in; a stream of chunks comes back, ending with exactly one
FinishChunk or ErrorChunk. All types are frozen, strict pydantic models so they travel as
msgpack dicts (model_dump) and are validated on arrival (model_validate).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from shoal.engine.sampling import SamplingParams


class WireModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ChatMessage(WireModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    name: str | None = None


class GenerationRequest(WireModel):
    """One completion job. Exactly one of prompt, messages, prompt_token_ids is set."""

    request_id: str
    model: str
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    priority: int = 0
    add_special_tokens: bool = True


class Usage(WireModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TopLogprobItem(WireModel):
    token_id: int
    token: str
    logprob: float


class LogprobItem(WireModel):
    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprobItem, ...] = ()


class AcceptedChunk(WireModel):
    """The runner validated and tokenized the request; generation will follow."""

    kind: Literal["accepted"] = "accepted"
    request_id: str
    prompt_tokens: int


class TokenChunk(WireModel):
    kind: Literal["token"] = "token"
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[LogprobItem, ...] = ()


class FinishChunk(WireModel):
    kind: Literal["finish"] = "finish"
    request_id: str
    finish_reason: Literal["stop", "length", "abort"]
    usage: Usage


ErrorCode = Literal[
    "invalid_request",  # a parameter is wrong (param names it) -> 400
    "context_length_exceeded",  # prompt (+ max_tokens) does not fit the context -> 400
    "model_not_found",  # -> 404
    "overloaded",  # queue full -> 429
    "unavailable",  # model not loaded / loading failed -> 503
    "runner_crashed",  # the runner died mid-request -> 500-class, reported as 503
    "timeout",  # a bounded wait ran out -> 504
    "internal",  # a bug -> 500
]


class ErrorChunk(WireModel):
    kind: Literal["error"] = "error"
    request_id: str
    code: ErrorCode
    message: str
    param: str | None = None


Chunk = Annotated[
    Union[AcceptedChunk, TokenChunk, FinishChunk, ErrorChunk], Field(discriminator="kind")
]


def chunk_to_wire(chunk: BaseModel) -> dict[str, Any]:
    return chunk.model_dump(mode="python")
