"""Messages between the supervisor (node process) and one runner subprocess.

supervisor -> runner: Load, Submit, Cancel, Shutdown
runner -> supervisor: Status, ChunkMessage, Failed
Each travels as one msgpack frame (see framing.py): model_dump() out, validate on arrival.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from shoal.engine.config import EngineConfig, ModelSource
from shoal.protocol import Chunk, GenerationRequest


class RunnerMessage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Load(RunnerMessage):
    """Build the engine. Fields mirror EngineConfig (paths as strings for msgpack)."""

    type: Literal["load"] = "load"
    model_id: str
    format: Literal["gguf", "safetensors"]
    path: str
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    device: str = "cpu"
    threads: int | None = None
    kv_cache_bytes: int | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 32
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    cache_dir: str | None = None
    # "module:callable" building the engine from (EngineConfig, progress); tests inject fakes.
    engine_factory: str | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, engine_factory: str | None = None) -> Load:
        return cls(model_id=config.source.model_id, format=config.source.format,
                   path=str(config.source.path), dtype=config.dtype, device=config.device,
                   threads=config.threads, kv_cache_bytes=config.kv_cache_bytes,
                   block_size=config.block_size,
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                   enable_prefix_caching=config.enable_prefix_caching,
                   cache_dir=None if config.cache_dir is None else str(config.cache_dir),
                   engine_factory=engine_factory)

    def to_config(self) -> EngineConfig:
        source = ModelSource(model_id=self.model_id, format=self.format, path=Path(self.path))
        return EngineConfig(source=source, dtype=self.dtype, device=self.device,
                            threads=self.threads, kv_cache_bytes=self.kv_cache_bytes,
                            block_size=self.block_size,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                            enable_prefix_caching=self.enable_prefix_caching,
                            cache_dir=None if self.cache_dir is None else Path(self.cache_dir))


class Submit(RunnerMessage):
    type: Literal["submit"] = "submit"
    request: GenerationRequest


class Cancel(RunnerMessage):
    type: Literal["cancel"] = "cancel"
    request_id: str


class Shutdown(RunnerMessage):
    type: Literal["shutdown"] = "shutdown"


class ModelInfo(RunnerMessage):
    model_id: str
    max_model_len: int
    vocab_size: int
    has_chat_template: bool


class Status(RunnerMessage):
    type: Literal["status"] = "status"
    state: Literal["loading", "ready", "failed"]
    stage: str = ""
    progress: float = 0.0
    model: ModelInfo | None = None


class ChunkMessage(RunnerMessage):
    type: Literal["chunk"] = "chunk"
    chunk: Chunk


class Failed(RunnerMessage):
    """The runner cannot go on (load failed, engine broken); it exits after sending this."""

    type: Literal["failed"] = "failed"
    message: str
    error_type: str = ""


ToRunner = Annotated[Union[Load, Submit, Cancel, Shutdown], Field(discriminator="type")]
FromRunner = Annotated[Union[Status, ChunkMessage, Failed], Field(discriminator="type")]

_to_runner = TypeAdapter(ToRunner)
_from_runner = TypeAdapter(FromRunner)


def parse_to_runner(raw: dict[str, Any]) -> Load | Submit | Cancel | Shutdown:
    return _to_runner.validate_python(raw)


def parse_from_runner(raw: dict[str, Any]) -> Status | ChunkMessage | Failed:
    return _from_runner.validate_python(raw)


def to_wire(message: RunnerMessage) -> dict[str, Any]:
    return message.model_dump(mode="python")
