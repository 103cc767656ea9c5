"""Wire types shared by the API, the router and the runner.

A GenerationRequest goes in; a stream of chunks comes back, ending with exactly one
FinishChunk or ErrorChunk. An ImageRequest's stream is ImageProgressChunks and ImageChunks,
then one ImagesDone or ErrorChunk. All types are frozen, strict pydantic models so they travel as
msgpack dicts (model_dump) and are validated on arrival (model_validate).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shoal.engine.sampling import SamplingParams
from shoal.tracing.traceparent import SPAN_ID_PATTERN, TRACE_ID_PATTERN


class WireModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ToolCall(WireModel):
    """One function call the model made; arguments is the JSON text of an object."""

    id: str
    name: str
    arguments: str


ImageMediaType = Literal["image/png", "image/jpeg", "image/gif", "image/bmp"]


class ImageInput(WireModel):
    """An image a chat turn shows the model: its encoded file, as the client sent it."""

    media_type: ImageMediaType
    data: bytes


class ChatMessage(WireModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    # Images the turn shows the model, placed before its text; only a model that takes
    # images (llama-server with a projector) accepts a request that has any.
    images: tuple[ImageInput, ...] = ()
    name: str | None = None
    # An assistant turn's reasoning as the client sent it back (reasoning_content,
    # thinking); the chat format decides whether the model sees it again.
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call this result answers


class ToolSpec(WireModel):
    """A function the model may call; parameters is its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)


class ForcedTool(WireModel):
    """tool_choice naming one function: the model must call exactly it."""

    name: str


ToolChoice = Union[Literal["auto", "none", "required"], ForcedTool]


class ResponseFormat(WireModel):
    """Constrains the output: free text, any JSON object, or JSON valid under a schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None  # set exactly when type is "json_schema"


ReasoningEffort = Literal["low", "medium", "high"]


class ReasoningRequest(WireModel):
    """What the client asked of a reasoning model: whether to reason (and get the reasoning
    back as ReasoningChunks) and how hard. A model that cannot stop reasoning (harmony)
    still reasons when enabled is False, but its reasoning is not returned."""

    enabled: bool = True
    effort: ReasoningEffort | None = None  # None: the model's default
    # The client's field that asked for it, named when a model without reasoning refuses.
    param: str = "reasoning"


class TraceRef(WireModel):
    """The trace a request belongs to and the span its work happens under (the accepting
    node's server span): spans recorded for it anywhere name these."""

    trace_id: str = Field(pattern=TRACE_ID_PATTERN)
    span_id: str = Field(pattern=SPAN_ID_PATTERN)


class GenerationRequest(WireModel):
    """One completion job. Exactly one of prompt, messages, prompt_token_ids is set."""

    request_id: str
    model: str
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    priority: int = 5  # 0 most urgent .. 9 least
    client_id: str | None = None  # who asked: per-client caps; never reaches the model
    add_special_tokens: bool = True
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = "auto"
    response_format: ResponseFormat | None = None
    # None: a reasoning model reasons by its default and returns its reasoning; a model
    # without reasoning generates as always.
    reasoning: ReasoningRequest | None = None
    # How long the model stays loaded after this request, in seconds: None is the server's
    # default, 0 unloads it once idle, a negative value keeps it loaded indefinitely.
    keep_alive_s: float | None = None
    # Tokenize the prompt and answer AcceptedChunk(prompt_tokens) then FinishChunk, generating
    # nothing: token counting, and loading a model (Ollama's empty prompt) through submit().
    count_only: bool = False
    trace: TraceRef | None = None  # None: nothing is recorded for it
    # x_session_id: a conversation's turns go to the instance that served it last (its KV
    # is there) while that instance lives; never reaches the model.
    session_id: str | None = None

    @property
    def has_images(self) -> bool:
        return any(message.images for message in self.messages or ())


class Usage(WireModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # Speculative decoding (an extension): tokens guessed, and how many were kept.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # Of completion_tokens, those the model spent reasoning (ReasoningChunks, or dropped).
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def speculative_json(self) -> dict[str, Any]:
        """The usage extension of a request that guessed tokens; {} for one that did not."""
        if not self.draft_tokens:
            return {}
        return {"x_speculative": {"proposed_tokens": self.draft_tokens,
                                  "accepted_tokens": self.accepted_draft_tokens}}


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
    model: str | None = None  # the model that serves it (a task ladder's choice), if known


class TokenChunk(WireModel):
    kind: Literal["token"] = "token"
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[LogprobItem, ...] = ()


class ReasoningChunk(WireModel):
    """Text the model wrote while reasoning, kept apart from the answer (TokenChunk)."""

    kind: Literal["reasoning"] = "reasoning"
    request_id: str
    text: str
    token_ids: tuple[int, ...] = ()


class ToolCallChunk(WireModel):
    """A complete tool call parsed from the model's output (index counts from 0)."""

    kind: Literal["tool_call"] = "tool_call"
    request_id: str
    index: int
    call: ToolCall


class FinishChunk(WireModel):
    kind: Literal["finish"] = "finish"
    request_id: str
    finish_reason: Literal["stop", "length", "abort", "tool_calls"]
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended generation, if one did


ErrorCode = Literal[
    "invalid_request",  # a parameter is wrong (param names it) -> 400
    "context_length_exceeded",  # prompt (+ max_tokens) does not fit the context -> 400
    "model_not_found",  # -> 404
    "overloaded",  # queue full -> 429
    "unavailable",  # model not loaded / loading failed -> 503
    "runner_crashed",  # the runner died mid-request -> 500-class, reported as 503
    "timeout",  # a bounded wait ran out -> 504
    "cancelled",  # ended by POST /v1/requests/{id}/cancel before it started -> 499
    "internal",  # a bug -> 500
]


class ErrorChunk(WireModel):
    kind: Literal["error"] = "error"
    request_id: str
    code: ErrorCode
    message: str
    param: str | None = None
    retry_after_s: int | None = None  # overloaded: when a retry may find room


class EmbeddingRequest(WireModel):
    """Embed a batch of inputs: exactly one of texts or token_ids is set. An empty batch
    only loads the model (Ollama's way of preloading an embedding model)."""

    request_id: str
    model: str
    texts: tuple[str, ...] | None = None
    token_ids: tuple[tuple[int, ...], ...] | None = None  # used as given, no special tokens
    # Cut inputs longer than the model's context instead of failing the request.
    truncate: bool = False
    priority: int = 5  # 0 most urgent .. 9 least
    client_id: str | None = None  # as in GenerationRequest
    keep_alive_s: float | None = None  # as in GenerationRequest
    trace: TraceRef | None = None  # as in GenerationRequest

    @model_validator(mode="after")
    def _one_kind_of_input(self) -> EmbeddingRequest:
        if (self.texts is None) == (self.token_ids is None):
            raise ValueError("exactly one of texts or token_ids must be set")
        return self

    @property
    def num_inputs(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids or ())


class EmbeddingResult(WireModel):
    """The terminal chunk of an EmbeddingRequest: one vector per input, in input order."""

    kind: Literal["embedding"] = "embedding"
    request_id: str
    embeddings: tuple[tuple[float, ...], ...]
    prompt_tokens: int
    # Seconds this request waited for the model to load (0 when it was loaded already).
    load_duration_s: float = 0.0


class ImageRequest(WireModel):
    """Draw n images for a prompt with a diffusers pipeline. width and height are both set or
    both None (the pipeline's default size); steps and guidance_scale None: the pipeline's
    defaults. The same seed, prompt and settings give the same images on one device."""

    request_id: str
    model: str
    prompt: str = Field(min_length=1)
    negative_prompt: str | None = None
    n: int = Field(default=1, ge=1)
    width: int | None = Field(default=None, ge=1)
    height: int | None = Field(default=None, ge=1)
    steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0)
    seed: int = Field(ge=0)
    priority: int = 5  # as in GenerationRequest
    client_id: str | None = None  # as in GenerationRequest
    keep_alive_s: float | None = None  # as in GenerationRequest
    trace: TraceRef | None = None  # as in GenerationRequest

    @model_validator(mode="after")
    def _both_sides(self) -> ImageRequest:
        if (self.width is None) != (self.height is None):
            raise ValueError("width and height are set together or not at all")
        return self


class ImageProgressChunk(WireModel):
    """The pipeline finished denoising step `step` of `steps` (all n images at once)."""

    kind: Literal["image_progress"] = "image_progress"
    request_id: str
    step: int
    steps: int


class ImageChunk(WireModel):
    """One finished image of an ImageRequest: a PNG, base64-encoded (as the API returns it,
    and as msgpack carries text)."""

    kind: Literal["image"] = "image"
    request_id: str
    index: int
    png_base64: str
    width: int
    height: int


class ImagesDone(WireModel):
    """The terminal chunk of an ImageRequest: every ImageChunk was sent."""

    kind: Literal["images_done"] = "images_done"
    request_id: str
    seed: int
    steps: int  # denoising steps run
    seconds: float  # wall time of the pipeline


Chunk = Annotated[
    AcceptedChunk | TokenChunk | ReasoningChunk | ToolCallChunk | FinishChunk | ErrorChunk
    | EmbeddingResult | ImageProgressChunk | ImageChunk | ImagesDone,
    Field(discriminator="kind")
]


def chunk_to_wire(chunk: BaseModel) -> dict[str, Any]:
    return chunk.model_dump(mode="python")
