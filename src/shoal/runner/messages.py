"""Messages between the supervisor (node process) and one runner subprocess.

supervisor -> runner: Load, Submit, Embed, Cancel, Inspect, Shutdown, Proposed, GrantKV
runner -> supervisor: Status, ChunkMessage, ChunkBatch, MemoryUsage, Inspection, Failed,
                      Propose, ForgetProposals, AskKV, ReleasedKV
Prefix KV between nodes (prefix_messages.py) adds supervisor -> runner PrefixPart,
PrefixFetched, PrefixExport and runner -> supervisor PrefixReport, PrefixWanted,
PrefixExportPart.
Each travels as one msgpack frame (see framing.py): model_dump() out, validate on arrival.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter

from shoal.engine.config import EngineConfig
from shoal.protocol import Chunk, EmbeddingRequest, GenerationRequest
from shoal.runner.prefix_messages import (
    PrefixExport,
    PrefixExportPart,
    PrefixFetched,
    PrefixMessage,
    PrefixPart,
    PrefixReport,
    PrefixWanted,
    RunnerMessage,
)


class Load(RunnerMessage):
    """Build the engine. Fields mirror EngineConfig (paths as strings for msgpack)."""

    type: Literal["load"] = "load"
    engine: EngineConfig


class Submit(RunnerMessage):
    type: Literal["submit"] = "submit"
    request: GenerationRequest


class Embed(RunnerMessage):
    """Embed a batch; answered by one EmbeddingResult or ErrorChunk."""

    type: Literal["embed"] = "embed"
    request: EmbeddingRequest


class Cancel(RunnerMessage):
    type: Literal["cancel"] = "cancel"
    request_id: str


class Inspect(RunnerMessage):
    """Asks what the runner recorded: one trace's spans, or its flight recorder. The
    socket's reader thread answers (an Inspection) at once, mid-step or mid-load alike."""

    type: Literal["inspect"] = "inspect"
    query_id: int
    what: Literal["trace", "flight"]
    trace_id: str | None = None  # what == "trace"


class Inspection(RunnerMessage):
    """The answer to Inspect query_id: {"spans": [...]} for a trace (spans.Span.to_wire),
    the flight recorder's snapshot for "flight"."""

    type: Literal["inspection"] = "inspection"
    query_id: int
    body: dict[str, Any]


class Propose(RunnerMessage):
    """Guesses wanted from a proposer node (runner/proposals.py): its session keeps the
    first `cut` tokens it holds for the request, appends `tokens`, and guesses up to k."""

    type: Literal["propose"] = "propose"
    call_id: int
    request_id: str
    cut: int = Field(ge=0)
    tokens: tuple[int, ...]
    k: int = Field(ge=0)
    timeout_s: float = Field(gt=0)


class Proposed(RunnerMessage):
    """The answer to Propose call_id, answered by the socket's reader thread: "ok" with the
    guesses, "resync" (send the whole context next time) or "none"."""

    type: Literal["proposed"] = "proposed"
    call_id: int
    outcome: Literal["ok", "resync", "none"]
    tokens: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()


class ForgetProposals(RunnerMessage):
    """The request ended: its proposer node may drop its session."""

    type: Literal["forget_proposals"] = "forget_proposals"
    request_id: str


class Shutdown(RunnerMessage):
    type: Literal["shutdown"] = "shutdown"


class ModelInfo(RunnerMessage):
    model_id: str
    max_model_len: int
    vocab_size: int
    has_chat_template: bool
    task: Literal["generate", "embed", "image"] = "generate"
    # Its chat format streams reasoning apart (harmony, think tags): Ollama's "thinking".
    reasons: bool = False
    embedding_dimensions: int | None = None  # set for embedding models
    takes_images: bool = False  # chat turns may carry images (llama-server with a projector)


class Status(RunnerMessage):
    type: Literal["status"] = "status"
    state: Literal["loading", "ready", "failed"]
    stage: str = ""
    progress: float = 0.0
    model: ModelInfo | None = None


class ChunkMessage(RunnerMessage):
    type: Literal["chunk"] = "chunk"
    chunk: Chunk


class ChunkBatch(RunnerMessage):
    """The chunks of one engine step, in order: one frame for the whole batch of requests
    (16 streams send 16-32 chunks a step) instead of one frame each."""

    type: Literal["chunks"] = "chunks"
    chunks: tuple[Chunk, ...]


class MemoryUsage(RunnerMessage):
    """What the runner holds in memory now (runner/memory.py): sent before its ready Status,
    then while it runs whenever a figure changed (at least every HEARTBEAT_S). None: the
    engine cannot tell. A rank of a multi-rank instance reports its own share."""

    type: Literal["memory"] = "memory"
    weights_bytes: int | None = None  # the weights as held (packed GGUF stays near file size)
    kv_bytes_in_use: int | None = None  # KV cache blocks that requests hold now
    kv_bytes_cached: int | None = None  # free blocks kept resident (prefix cache, spent)
    kv_bytes_capacity: int | None = None  # every KV cache block (address space, touched lazily)
    # The KV blocks the node lets it touch (runner/kv_grant.py); None: no grant (a
    # follower rank or an embedder, whose KV is what it touched).
    kv_bytes_granted: int | None = None
    # Resident memory the runner process holds on its own (runner/memory.py
    # private_resident_bytes: not shared libraries' pages); a server that maps its weights
    # file (llama-server) counts its whole RSS, the mapped weights included.
    rss_bytes: int | None = None
    # Memory it holds on accelerators (a GPU's), which no RSS counts: llama-server's
    # buffers on the devices its build drives. None: it holds none, or cannot tell.
    device_bytes: int | None = None

    @property
    def held_bytes(self) -> int | None:
        """Weights plus the KV cache requests and the prefix cache hold: what the model
        holds beyond the process's own floor."""
        if self.weights_bytes is None:
            return None
        return self.weights_bytes + (self.kv_bytes_in_use or 0) + (self.kv_bytes_cached or 0)

    @property
    def footprint_bytes(self) -> int | None:
        """What the runner may hold without asking: its resident memory (weights, KV blocks
        touched, its runtime floor) plus the granted KV blocks it has not touched yet.
        Counted against the node's budget and shown by /api/ps."""
        if self.rss_bytes is None:
            return None
        touched = (self.kv_bytes_in_use or 0) + (self.kv_bytes_cached or 0)
        return self.rss_bytes + max(0, (self.kv_bytes_granted or 0) - touched)


class AskKV(RunnerMessage):
    """The runner's KV blocks in use near its grant: it asks the node for more_blocks more
    (bytes_per_block each) on top of granted_blocks. Answered by one GrantKV."""

    type: Literal["ask_kv"] = "ask_kv"
    granted_blocks: int = Field(ge=0)
    more_blocks: int = Field(gt=0)
    bytes_per_block: int = Field(gt=0)


class ReleasedKV(RunnerMessage):
    """The runner, idle, gave the memory of its spare KV blocks back: its grant is now
    granted_blocks (sent only while no AskKV is out, so no GrantKV crosses it)."""

    type: Literal["released_kv"] = "released_kv"
    granted_blocks: int = Field(ge=0)
    bytes_per_block: int = Field(gt=0)


class GrantKV(RunnerMessage):
    """The node's answer to AskKV: the blocks the runner may now touch in all (unchanged
    when the node's budget has no room for more)."""

    type: Literal["grant_kv"] = "grant_kv"
    granted_blocks: int = Field(ge=0)


class Failed(RunnerMessage):
    """The runner cannot go on (load failed, engine broken); it exits after sending this."""

    type: Literal["failed"] = "failed"
    message: str
    error_type: str = ""


ToRunner = Annotated[Load | Submit | Embed | Cancel | Inspect | Shutdown | Proposed | GrantKV
                     | PrefixPart | PrefixFetched | PrefixExport, Field(discriminator="type")]
FromRunner = Annotated[Status | ChunkMessage | ChunkBatch | MemoryUsage | Inspection | Failed
                       | Propose | ForgetProposals | AskKV | ReleasedKV | PrefixReport
                       | PrefixWanted | PrefixExportPart, Field(discriminator="type")]

_to_runner = TypeAdapter(ToRunner)
_from_runner = TypeAdapter(FromRunner)


def parse_to_runner(raw: dict[str, Any]) -> RunnerMessage:
    return _to_runner.validate_python(raw)


def parse_from_runner(raw: dict[str, Any]) -> RunnerMessage:
    return _from_runner.validate_python(raw)


def to_wire(message: RunnerMessage) -> dict[str, Any]:
    if isinstance(message, PrefixMessage):
        return message.model_dump(mode="python")  # hashes and KV stay bytes
    # JSON mode turns paths into strings for msgpack; validation turns them back.
    return message.model_dump(mode="json")
