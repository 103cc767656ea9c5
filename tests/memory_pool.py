"""A model pool over in-memory supervisors: loads take LOAD_S, nothing spawns a process; and
a router over it in a standalone cluster of one node (in-memory transport).

Used by the pool, router and cluster tests.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fakes import write_fake_gguf

from shoal.catalog.resolve import ModelNotFound
from shoal.engine.config import EngineConfig, ModelSource
from shoal.engine.sampling import SamplingParams
from shoal.protocol import (
    AcceptedChunk,
    EmbeddingRequest,
    EmbeddingResult,
    ErrorChunk,
    FinishChunk,
    GenerationRequest,
    ImageChunk,
    ImageProgressChunk,
    ImageRequest,
    ImagesDone,
    TokenChunk,
    Usage,
)
from shoal.cluster.model_facts import model_facts_from_source
from shoal.cluster.placement import bytes_to_find, shard_bytes
from shoal.cluster.setup import open_cluster
from shoal.config import ClusterSettings
from shoal.pool.pool import ModelPool
from shoal.router import Router
from shoal.runner.messages import MemoryUsage
from shoal.runner.registry import RunnerRegistry
from shoal.runner.supervisor import RunnerUnavailable

LOAD_S = 0.05
# What each fake runner reports it holds once loaded (counted against a node's budget).
HELD_BYTES = 50 * 2**20


class MemorySupervisor:
    """RunnerSupervisor's interface in memory: loads take LOAD_S; "broken" fails to load;
    a prompt "hold:<seconds>" keeps its request running that long; "tokens:<n>:<seconds>"
    streams n tokens "t0 ", "t1 ", ... that far apart; "crash" ends it as a runner crash
    would, and "crash-once:<path>" does so while the file at path exists (removing it), else
    streams two tokens; "held-crash-once:<path>" is crash-once after a token whose text is
    held back (none shown yet). `submitted` lists the request ids it was given."""

    backend = "engine"

    def __init__(self, source: ModelSource, events: list) -> None:
        self.config = EngineConfig(source=source)
        self.model_id = source.model_id
        self.state = "stopped"
        self.expires_at = None
        self.last_error = None
        self.events = events
        self.memory: MemoryUsage | None = None
        self.memory_limit: int | None = None
        self.aborted: list[str] = []  # requests whose stream was closed before the end
        self.restarts = 0
        self.submitted: list[str] = []

    def limit_memory(self, limit_bytes: int | None) -> None:
        self.memory_limit = limit_bytes

    async def start(self) -> None:
        self.events.append(("start", self.model_id))
        self.state = "starting"
        await asyncio.sleep(LOAD_S)
        if self.model_id == "broken":
            self.state = "failed"
            raise RunnerUnavailable("loading 'broken' failed: bad weights")
        self.memory = MemoryUsage(weights_bytes=HELD_BYTES, rss_bytes=HELD_BYTES)
        self.state = "ready"

    async def wait_ready(self, timeout_s: float) -> None:
        if self.state != "ready":
            raise RunnerUnavailable(f"model {self.model_id!r} is {self.state}")

    async def shutdown(self) -> None:
        self.events.append(("stop", self.model_id))
        self.memory = None
        self.state = "stopped"

    async def submit(self, request: GenerationRequest):
        finished = False
        self.submitted.append(request.request_id)
        try:
            yield AcceptedChunk(request_id=request.request_id, prompt_tokens=1)
            count = 0
            if _crashes(request.prompt):
                if request.prompt.startswith("held-"):
                    yield TokenChunk(request_id=request.request_id, text="", token_ids=(0,))
                finished = True
                yield ErrorChunk(request_id=request.request_id, code="runner_crashed",
                                 message=f"the runner of {self.model_id} exited")
                return
            if request.prompt.startswith(("crash-once:", "held-crash-once:")):
                request = request.model_copy(update={"prompt": "tokens:2:0"})
            if request.prompt.startswith("hold:"):
                await asyncio.sleep(float(request.prompt[5:]))
            elif request.prompt.startswith("tokens:"):
                _, count, gap = request.prompt.split(":")
                for i in range(int(count)):
                    await asyncio.sleep(float(gap))
                    yield TokenChunk(request_id=request.request_id, text=f"t{i} ",
                                     token_ids=(i,))
            yield FinishChunk(request_id=request.request_id, finish_reason="stop",
                              usage=Usage(prompt_tokens=1, completion_tokens=int(count)))
            finished = True
        finally:
            if not finished:  # closed early: a real runner aborts the request here
                self.aborted.append(request.request_id)

    async def generate_images(self, request: ImageRequest):
        """Two steps, then one 1x1 image per n; a prompt "hold:<seconds>" takes that long
        between its steps."""
        self.events.append(("draw", request.request_id))
        yield ImageProgressChunk(request_id=request.request_id, step=1, steps=2)
        if request.prompt.startswith("hold:"):
            await asyncio.sleep(float(request.prompt[5:]))
        yield ImageProgressChunk(request_id=request.request_id, step=2, steps=2)
        for index in range(request.n):
            yield ImageChunk(request_id=request.request_id, index=index, png_base64="",
                             width=1, height=1)
        yield ImagesDone(request_id=request.request_id, seed=request.seed, steps=2, seconds=0.0)
        self.events.append(("drawn", request.request_id))

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        return EmbeddingResult(request_id=request.request_id,
                               embeddings=tuple((1.0, 0.0) for _ in request.texts),
                               prompt_tokens=len(request.texts))


def _crashes(prompt: str) -> bool:
    if prompt == "crash":
        return True
    if prompt.startswith(("crash-once:", "held-crash-once:")):
        marker = Path(prompt.split(":", 1)[1])
        if marker.exists():
            marker.unlink()
            return True
    return False


@pytest.fixture
def sources(tmp_path) -> dict[str, ModelSource]:
    weights, other = tmp_path / "weights.gguf", tmp_path / "other.gguf"
    write_fake_gguf(weights)
    write_fake_gguf(other)  # its own file: a size measured for "chat" is not its size
    directory = tmp_path / "encoder"
    directory.mkdir()
    (directory / "config.json").write_text(
        '{"num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 32}')
    painter = tmp_path / "painter"
    (painter / "unet").mkdir(parents=True)
    (painter / "model_index.json").write_text('{"unet": ["diffusers", "UNet2DConditionModel"]}')
    (painter / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(b"0" * 1024)
    return {"chat": ModelSource("chat", "gguf", weights),
            "painter": ModelSource("painter", "diffusers", painter, task="image"),
            "other": ModelSource("other", "gguf", other),
            "broken": ModelSource("broken", "gguf", weights),
            "embedder": ModelSource("embedder", "safetensors", Path(directory), task="embed")}


def make_pool(sources, events, **options) -> ModelPool:
    """options go to ModelPool (keep_alive_s)."""
    def resolve(name: str) -> ModelSource:
        if name not in sources:
            raise ModelNotFound(f"model {name!r} not found")
        return sources[name]

    registry = RunnerRegistry(lambda source, _parallel: MemorySupervisor(source, events))
    return ModelPool(registry, resolve=resolve, **options)


def one_model_budget(sources) -> int:
    """Room for one model as placement estimates it, not for two (a loaded one counts
    HELD_BYTES once it reports, its estimate until then)."""
    facts = model_facts_from_source(sources["chat"])
    needed = shard_bytes(facts, facts.n_layers)
    assert needed > 2 * HELD_BYTES
    # An estimate is tried when at most 15% over the room: that much room is enough.
    return bytes_to_find(facts, needed, whole=True) + HELD_BYTES // 2


async def make_router(sources, events, memory_budget: int | None = None,
                      max_loaded_models: int | None = None,
                      memory_wait_s: float = 5.0, ladders=None, **options) -> Router:
    """A router over make_pool's pool, its node a standalone cluster of one with the given
    budget; options go to ModelPool."""
    pool = make_pool(sources, events, **options)
    data_dir = Path(sources["chat"].path).parent / "node"
    cluster = await open_cluster(ClusterSettings(standalone=True), data_dir, pool, lambda: (),
                                 memory_budget=memory_budget,
                                 max_loaded_models=max_loaded_models)
    return Router(pool, cluster, memory_wait_s=memory_wait_s, ladders=ladders)


async def shutdown(router: Router) -> None:
    await router.cluster.stop()
    await router.shutdown()


def generate(name: str, prompt: str = "hi", keep_alive_s: float | None = None):
    return GenerationRequest(request_id=f"g-{prompt}", model=name, prompt=prompt,
                             sampling=SamplingParams(), keep_alive_s=keep_alive_s)


def draw(name: str, request_id: str = "i", prompt: str = "a boat",
         keep_alive_s: float | None = None) -> ImageRequest:
    return ImageRequest(request_id=request_id, model=name, prompt=prompt, seed=1,
                        keep_alive_s=keep_alive_s)


def embed(name: str, keep_alive_s: float | None = None, texts=("a",)):
    return EmbeddingRequest(request_id="e", model=name, texts=texts, keep_alive_s=keep_alive_s)


async def run(router: Router, request: GenerationRequest) -> list:
    return [chunk async for chunk in router.submit(request)]


def loaded(router: Router) -> list[str]:
    return sorted(s.model_id for s in router.supervisors)


