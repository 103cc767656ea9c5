"""Which runner serves a request: this node's pool, or an instance on another node.

A model this node runs (loaded, loading, or hosted for a cluster instance) is served here.
Otherwise, when the cluster has an instance of the model whose serving rank is on another
node, the request travels there as a task and its chunks stream back over the data plane.
Failing both, the pool loads the model here on first use. Embeddings are always served by
the local pool.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from shoal.engine.config import ModelTask
from shoal.pool.pool import (
    DEFAULT_KEEP_ALIVE_S,
    ModelPool,
    ModelUnavailable,
    Resolver,
    SupervisorFactory,
    WrongModelTask,
)
from shoal.protocol import (
    EmbeddingRequest,
    EmbeddingResult,
    ErrorChunk,
    GenerationRequest,
)
from shoal.runner.supervisor import RunnerSupervisor

__all__ = ["ModelUnavailable", "RemoteServing", "Router", "WrongModelTask"]


class RemoteServing(Protocol):
    """What the router needs of the cluster (shoal.cluster.service.ClusterService)."""

    def remote_instance_for(self, model_id: str) -> str | None:
        """The id of an instance of model_id served by another node, or None."""
        ...

    def model_named(self, name: str) -> str | None:
        """The model id of a cluster instance a client's name means, or None."""
        ...

    def submit_remote(self, request: GenerationRequest,
                      instance_id: str) -> AsyncIterator[Any]:
        """request's chunks from instance_id, ending with one FinishChunk or ErrorChunk."""
        ...


class Router:
    def __init__(self, make_supervisor: SupervisorFactory, resolve: Resolver | None = None,
                 load_on_demand: bool = True,
                 keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S,
                 clock: Callable[[], float] = time.time,
                 cluster: RemoteServing | None = None) -> None:
        self.pool = ModelPool(make_supervisor, resolve=resolve, load_on_demand=load_on_demand,
                              keep_alive_s=keep_alive_s, clock=clock)
        self.cluster = cluster

    @property
    def supervisors(self) -> list[RunnerSupervisor]:
        return self.pool.supervisors

    async def preload(self, names: Sequence[str]) -> None:
        await self.pool.preload(names)

    async def supervisor_for(self, name: str, start: bool | None = None) -> RunnerSupervisor:
        return await self.pool.supervisor_for(name, start)

    async def submit(self, request: GenerationRequest) -> AsyncIterator[Any]:
        """The request's chunks; an unknown or broken model yields one ErrorChunk."""
        remote = await self._remote_instance(request.model)
        if remote is None:
            stream = self.pool.submit(request)
        else:
            model_id, instance_id = remote
            stream = self.cluster.submit_remote(  # type: ignore[union-attr]
                request.model_copy(update={"model": model_id}), instance_id)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult | ErrorChunk:
        return await self.pool.embed(request)

    async def load(self, name: str, keep_alive_s: float | None = None) -> bool:
        return await self.pool.load(name, keep_alive_s)

    def canonical_id(self, name: str) -> str:
        canonical = self.pool.canonical_id(name)
        if canonical == name and self.cluster is not None:
            return self.cluster.model_named(name) or name
        return canonical

    def task_of(self, name: str) -> ModelTask | None:
        return self.pool.task_of(name)

    async def shutdown(self) -> None:
        await self.pool.shutdown()

    async def _remote_instance(self, name: str) -> tuple[str, str] | None:
        """(model id, instance id) when another node should serve name, else None."""
        if self.cluster is None:
            return None
        from shoal.catalog.resolve import ModelNotFound

        try:
            model_id = await self.pool.identify(name)
        except ModelNotFound:
            # Not resolvable here (a path on another machine, say): a cluster instance
            # of that name can still serve it; otherwise the pool reports the 404.
            model_id = self.cluster.model_named(name)
        except ValueError:
            return None  # a malformed name: the pool reports it
        if model_id is None or self.pool.is_resident(model_id):
            return None
        instance_id = self.cluster.remote_instance_for(model_id)
        return None if instance_id is None else (model_id, instance_id)
