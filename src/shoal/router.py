"""Maps a model id (or alias, or path) to the runner supervisor that serves it.

A model named by a request is resolved through the catalogue (shoal.catalog.resolve); if no
supervisor serves it yet and on-demand loading is on, one is started (bounded by its load
timeout). Concurrent first requests for one model share a single start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from shoal.engine.config import ModelSource
from shoal.protocol import ErrorChunk, GenerationRequest
from shoal.runner.supervisor import RunnerSupervisor, RunnerUnavailable

log = logging.getLogger("shoal.router")

SupervisorFactory = Callable[[ModelSource], RunnerSupervisor]
Resolver = Callable[[str], ModelSource]


class ModelUnavailable(RuntimeError):
    """The model is known but cannot serve (loading failed, crashed too often)."""


def _default_resolver(name: str) -> ModelSource:
    from shoal.catalog.resolve import resolve_generative_model

    return resolve_generative_model(name)


def _not_found_types() -> tuple[type[BaseException], ...]:
    from shoal.catalog.resolve import ModelNotFound

    return (ModelNotFound,)


class Router:
    def __init__(self, make_supervisor: SupervisorFactory, resolve: Resolver | None = None,
                 load_on_demand: bool = True) -> None:
        self._make_supervisor = make_supervisor
        self._resolve = resolve or _default_resolver
        self.load_on_demand = load_on_demand
        self._supervisors: dict[str, RunnerSupervisor] = {}  # by canonical model id
        self._names: dict[str, str] = {}  # any name a client used (lower case) -> model id
        self._starting: dict[str, asyncio.Task] = {}
        self._lock = asyncio.Lock()

    @property
    def supervisors(self) -> list[RunnerSupervisor]:
        return list(self._supervisors.values())

    async def preload(self, names: Sequence[str]) -> None:
        """Start every named model; raises ModelNotFound / ModelUnavailable on the first failure."""
        for name in names:
            await self.supervisor_for(name, start=True)

    async def supervisor_for(self, name: str, start: bool | None = None) -> RunnerSupervisor:
        """The supervisor serving name, starting it if allowed; ModelNotFound if unknown."""
        model_id = self._names.get(name.lower())
        if model_id is None:
            source = await asyncio.to_thread(self._resolve, name)  # may hash or assemble files
            model_id = source.model_id
            self._names[name.lower()] = model_id
            self._names[model_id.lower()] = model_id
        else:
            source = None
        supervisor = self._supervisors.get(model_id)
        if supervisor is not None and supervisor.state != "stopped":
            return supervisor
        if not (self.load_on_demand if start is None else start):
            raise ModelUnavailable(f"model {name!r} is not loaded on this node")
        return await self._start(model_id, source or await asyncio.to_thread(self._resolve, name))

    async def _start(self, model_id: str, source: ModelSource) -> RunnerSupervisor:
        async with self._lock:
            task = self._starting.get(model_id)
            if task is None:
                task = asyncio.get_running_loop().create_task(self._start_one(model_id, source))
                self._starting[model_id] = task
                task.add_done_callback(lambda _t: self._starting.pop(model_id, None))
        return await asyncio.shield(task)

    async def _start_one(self, model_id: str, source: ModelSource) -> RunnerSupervisor:
        supervisor = self._supervisors.get(model_id)
        if supervisor is None:
            supervisor = self._make_supervisor(source)
            self._supervisors[model_id] = supervisor
        log.info("starting model %s from %s", model_id, source.path)
        try:
            await supervisor.start()
        except RunnerUnavailable as error:
            raise ModelUnavailable(str(error)) from error
        return supervisor

    async def submit(self, request: GenerationRequest) -> AsyncIterator[Any]:
        """The request's chunks; an unknown or broken model yields one ErrorChunk."""
        try:
            supervisor = await self.supervisor_for(request.model)
        except _not_found_types() as error:
            yield ErrorChunk(request_id=request.request_id, code="model_not_found",
                             message=str(error), param="model")
            return
        except ValueError as error:
            yield ErrorChunk(request_id=request.request_id, code="invalid_request",
                             message=str(error), param="model")
            return
        except ModelUnavailable as error:
            yield ErrorChunk(request_id=request.request_id, code="unavailable",
                             message=str(error))
            return
        stream = supervisor.submit(request)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

    def canonical_id(self, name: str) -> str:
        return self._names.get(name.lower(), name)

    async def shutdown(self) -> None:
        for task in list(self._starting.values()):
            task.cancel()
        await asyncio.gather(*(s.shutdown() for s in self._supervisors.values()),
                             return_exceptions=True)
