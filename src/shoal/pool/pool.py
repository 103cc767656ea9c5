"""The models this node runs: a model id (or alias, or path) -> the runner supervisor serving it.

A model named by a request is identified (names.py); if no supervisor serves it yet and
on-demand loading is on, one is started (bounded by its load timeout). Concurrent first requests for one model share a single start.

Keep-alive: each request holds its model while it runs. When a model's last request ends,
a timer starts; if no request arrives before it runs out, the runner is stopped and the next
request loads the model again. A request's keep_alive_s sets that time (0 unloads at once,
negative never); without one, models named at start (preload) stay loaded and models loaded
on demand get the server default.

Hosting: the cluster's worker pins a model for a placed instance (host / unhost); a hosted
model stays loaded whatever the keep-alive says until its last instance lets go. Each fresh
runner of a model gets a new residency generation, so the cluster can tell "the runner it
mirrored" from "a runner started again since".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.engine.config import ModelSource, ModelTask
from shoal.pool.names import ModelNames, Resolver, WrongModelTask
from shoal.protocol import (
    EmbeddingRequest,
    EmbeddingResult,
    ErrorChunk,
    GenerationRequest,
)
from shoal.runner.supervisor import RunnerSupervisor, RunnerUnavailable

__all__ = ["DEFAULT_KEEP_ALIVE_S", "ModelPool", "ModelUnavailable", "Residency", "Resolver",
           "SupervisorFactory", "WrongModelTask"]

log = logging.getLogger("shoal.pool")

SupervisorFactory = Callable[[ModelSource], RunnerSupervisor]

# How long a model loaded on demand stays loaded after its last request, by default.
DEFAULT_KEEP_ALIVE_S = 300.0


class ModelUnavailable(RuntimeError):
    """The model is known but cannot serve (loading failed, crashed too often)."""


def _not_found_types() -> tuple[type[BaseException], ...]:
    from shoal.catalog.resolve import ModelNotFound

    return (ModelNotFound,)


@dataclass
class _Residency:
    """Keep-alive bookkeeping of one model id (kept across unloads)."""

    pinned: bool = False  # named at start: stays loaded unless a request asks otherwise
    active: int = 0  # requests holding the model, from resolving it to their last chunk
    keep_alive_s: float | None = None  # set by the latest request; None keeps it loaded
    timer: asyncio.Task | None = None
    hosts: set[str] = field(default_factory=set)  # cluster instances pinning the model
    generation: int = 0  # counts the runners started for this model id


@dataclass(frozen=True)
class Residency:
    """A model this pool runs now, as the cluster mirrors it."""

    model_id: str
    generation: int
    state: str  # the supervisor's state
    hosted: bool  # pinned by a cluster instance
    error: str | None = None


@dataclass(frozen=True)
class _Lease:
    model_id: str
    supervisor: RunnerSupervisor
    load_duration_s: float  # how long this request waited for the model to start


class ModelPool:
    def __init__(self, make_supervisor: SupervisorFactory, resolve: Resolver | None = None,
                 load_on_demand: bool = True,
                 keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S,
                 clock: Callable[[], float] = time.time) -> None:
        if keep_alive_s is not None and keep_alive_s < 0:
            raise ValueError("keep_alive_s must be >= 0, or None to keep models loaded")
        self._make_supervisor = make_supervisor
        self._names = ModelNames(resolve)
        self.load_on_demand = load_on_demand
        self.keep_alive_s = keep_alive_s  # the server default for models loaded on demand
        self._clock = clock
        self._supervisors: dict[str, RunnerSupervisor] = {}  # by canonical model id
        self._residency: dict[str, _Residency] = {}
        self._starting: dict[str, asyncio.Task] = {}
        self._stopping: dict[str, asyncio.Task] = {}
        self._lock = asyncio.Lock()
        self._listeners: list[Callable[[str], None]] = []

    @property
    def supervisors(self) -> list[RunnerSupervisor]:
        """The runners that exist now (loaded, loading or failed), not the ones unloaded."""
        return list(self._supervisors.values())

    async def preload(self, names: Sequence[str]) -> None:
        """Start every named model and keep it loaded; raises ModelNotFound /
        ModelUnavailable on the first failure."""
        for name in names:
            model_id, source = await self._names.identify(name)
            self._residency.setdefault(model_id, _Residency()).pinned = True
            await self._running(model_id, name, source, start=True)

    def on_change(self, listener: Callable[[str], None]) -> None:
        """listener(model_id) whenever a model starts loading, finishes starting or unloads."""
        self._listeners.append(listener)

    def residencies(self) -> list[Residency]:
        """The models with a runner now (loading, ready or failed), not the unloaded ones."""
        out = []
        for model_id, supervisor in self._supervisors.items():
            residency = self._residency.get(model_id) or _Residency()
            out.append(Residency(model_id, residency.generation, supervisor.state,
                                 bool(residency.hosts), getattr(supervisor, "last_error", None)))
        return out

    def is_resident(self, model_id: str) -> bool:
        supervisor = self._supervisors.get(model_id)
        return supervisor is not None and supervisor.state != "stopped"

    def source_of(self, model_id: str) -> ModelSource:
        """Where a running model's weights are (KeyError if it is not running)."""
        return self._supervisors[model_id].config.source

    async def identify(self, name: str) -> str:
        """The canonical model id of name (ModelNotFound if unknown)."""
        model_id, _ = await self._names.identify(name)
        return model_id

    async def host(self, name: str, instance_id: str) -> RunnerSupervisor:
        """Pin the model for a cluster instance and make sure it runs (ModelUnavailable if
        it cannot start; the pin stays until unhost)."""
        model_id, source = await self._names.identify(name)
        residency = self._residency.setdefault(model_id, _Residency())
        residency.hosts.add(instance_id)
        if residency.timer is not None:
            residency.timer.cancel()
            residency.timer = None
        supervisor = await self._running(model_id, name, source, start=True)
        self._stamp_expiry(supervisor, None)
        return supervisor

    def unhost(self, model_id: str, instance_id: str) -> None:
        """Drop an instance's pin; the last one going unloads the model once idle, unless it
        was named at start."""
        residency = self._residency.get(model_id)
        if residency is None or instance_id not in residency.hosts:
            return
        residency.hosts.discard(instance_id)
        if not residency.hosts and not residency.pinned:
            self.unload(model_id)

    def unload(self, model_id: str) -> None:
        """Stop the model's runner as soon as no request holds it (now, if none does)."""
        residency = self._residency.get(model_id)
        supervisor = self._supervisors.get(model_id)
        if residency is None or supervisor is None or residency.hosts:
            return
        residency.pinned = False
        residency.keep_alive_s = 0.0
        if residency.timer is not None:
            residency.timer.cancel()
            residency.timer = None
        if not residency.active:
            residency.timer = asyncio.get_running_loop().create_task(
                self._expire(model_id, supervisor, 0.0))

    async def supervisor_for(self, name: str, start: bool | None = None) -> RunnerSupervisor:
        """The supervisor serving name, starting it if allowed; ModelNotFound if unknown."""
        model_id, source = await self._names.identify(name)
        return await self._running(model_id, name, source, start)

    # ---- requests -------------------------------------------------------------------------

    async def submit(self, request: GenerationRequest) -> AsyncIterator[Any]:
        """The request's chunks; an unknown or broken model yields one ErrorChunk."""
        try:
            lease = await self._acquire(request.model, "generate", request.keep_alive_s)
        except Exception as error:  # noqa: BLE001 - _refusal re-raises what it cannot map
            yield _refusal(request.request_id, error)
            return
        try:
            stream = lease.supervisor.submit(request)
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                await stream.aclose()
        finally:
            self._release(lease.model_id)

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult | ErrorChunk:
        """The request's vectors, or one ErrorChunk. An empty batch just loads the model."""
        try:
            lease = await self._acquire(request.model, "embed", request.keep_alive_s)
        except Exception as error:  # noqa: BLE001 - _refusal re-raises what it cannot map
            return _refusal(request.request_id, error)
        try:
            if request.num_inputs == 0:
                return EmbeddingResult(request_id=request.request_id, embeddings=(),
                                       prompt_tokens=0, load_duration_s=lease.load_duration_s)
            result = await lease.supervisor.embed(request)
        finally:
            self._release(lease.model_id)
        if isinstance(result, EmbeddingResult):
            return result.model_copy(update={"load_duration_s": lease.load_duration_s})
        return result

    async def load(self, name: str, keep_alive_s: float | None = None) -> bool:
        """Apply a keep-alive with no request to run (Ollama's empty request): load the model
        unless keep_alive_s is 0, which unloads a loaded model once idle. True if loaded
        afterwards (or stopping after its keep-alive)."""
        if keep_alive_s == 0:
            model_id, _ = await self._names.identify(name)
            if model_id not in self._supervisors:
                return False
        lease = await self._acquire(name, None, keep_alive_s)
        self._release(lease.model_id)
        return True

    def canonical_id(self, name: str) -> str:
        return self._names.canonical_id(name)

    def task_of(self, name: str) -> ModelTask | None:
        """What a model already resolved does ("generate" / "embed"); None if not yet known."""
        return self._names.task_of(name)

    async def shutdown(self) -> None:
        for residency in self._residency.values():
            if residency.timer is not None:
                residency.timer.cancel()
        for task in list(self._starting.values()):
            task.cancel()
        await asyncio.gather(*(s.shutdown() for s in self._supervisors.values()),
                             *self._stopping.values(), return_exceptions=True)

    # ---- starting ---------------------------------------------------------------------------

    async def _running(self, model_id: str, name: str, source: ModelSource | None,
                       start: bool | None) -> RunnerSupervisor:
        supervisor = self._supervisors.get(model_id)
        if supervisor is not None and supervisor.state != "stopped":
            return supervisor
        if not (self.load_on_demand if start is None else start):
            raise ModelUnavailable(f"model {name!r} is not loaded on this node")
        return await self._start(model_id, source or await self._names.resolve(name))

    async def _start(self, model_id: str, source: ModelSource) -> RunnerSupervisor:
        async with self._lock:
            task = self._starting.get(model_id)
            if task is None:
                task = asyncio.get_running_loop().create_task(self._start_one(model_id, source))
                self._starting[model_id] = task
                task.add_done_callback(lambda _t: self._starting.pop(model_id, None))
        return await asyncio.shield(task)

    async def _start_one(self, model_id: str, source: ModelSource) -> RunnerSupervisor:
        stopping = self._stopping.get(model_id)
        if stopping is not None:  # the previous runner is still shutting down (bounded)
            await asyncio.shield(stopping)
        supervisor = self._supervisors.get(model_id)
        if supervisor is None:
            supervisor = self._make_supervisor(source)
            self._supervisors[model_id] = supervisor
            self._residency.setdefault(model_id, _Residency()).generation += 1
        log.info("starting model %s from %s", model_id, source.path)
        self._notify(model_id)
        try:
            await supervisor.start()
        except RunnerUnavailable as error:
            raise ModelUnavailable(str(error)) from error
        finally:
            self._notify(model_id)
        return supervisor

    def _notify(self, model_id: str) -> None:
        for listener in list(self._listeners):
            try:
                listener(model_id)
            except Exception:  # a faulty listener must not break loading
                log.exception("pool listener failed for %s", model_id)

    # ---- keep-alive -----------------------------------------------------------------------

    async def _acquire(self, name: str, task: ModelTask | None,
                       keep_alive_s: float | None) -> _Lease:
        """Hold the model (no unload while held) and make sure it runs; release with
        _release. Raises what identify and _running raise."""
        model_id, source = await self._names.identify(name, task)
        residency = self._residency.setdefault(model_id, _Residency())
        residency.active += 1  # before any await: the idle timer must not fire from here on
        if residency.timer is not None:
            residency.timer.cancel()
            residency.timer = None
        residency.keep_alive_s = self._keep_alive_for(keep_alive_s, residency)
        try:
            supervisor = self._supervisors.get(model_id)
            waited = supervisor is None or supervisor.state != "ready"
            started = time.monotonic()
            supervisor = await self._running(model_id, name, source, None)
        except BaseException:
            self._release(model_id)
            raise
        load_s = time.monotonic() - started if waited else 0.0
        self._stamp_expiry(supervisor, residency.keep_alive_s)
        return _Lease(model_id, supervisor, load_s)

    def _keep_alive_for(self, requested: float | None, residency: _Residency) -> float | None:
        """Seconds to stay loaded once idle; None means indefinitely."""
        if residency.hosts:
            return None  # a cluster instance holds it
        if requested is None:
            return None if residency.pinned else self.keep_alive_s
        return None if requested < 0 else float(requested)

    def _stamp_expiry(self, supervisor: RunnerSupervisor, keep_alive_s: float | None) -> None:
        supervisor.expires_at = None if keep_alive_s is None else self._clock() + keep_alive_s

    def _release(self, model_id: str) -> None:
        residency = self._residency[model_id]
        residency.active -= 1
        supervisor = self._supervisors.get(model_id)
        if residency.active or supervisor is None:
            return
        keep = residency.keep_alive_s
        self._stamp_expiry(supervisor, keep)
        if keep is not None:
            residency.timer = asyncio.get_running_loop().create_task(
                self._expire(model_id, supervisor, keep))

    async def _expire(self, model_id: str, supervisor: RunnerSupervisor, after_s: float) -> None:
        await asyncio.sleep(after_s)
        residency = self._residency[model_id]
        if (residency.active or residency.hosts
                or self._supervisors.get(model_id) is not supervisor):
            return
        residency.timer = None
        log.info("unloading model %s: idle for %.0f s", model_id, after_s)
        del self._supervisors[model_id]  # from now on a request starts a fresh runner
        stop = asyncio.get_running_loop().create_task(supervisor.shutdown())
        self._stopping[model_id] = stop
        stop.add_done_callback(lambda _t: self._forget_stop(model_id, stop))
        self._notify(model_id)

    def _forget_stop(self, model_id: str, stop: asyncio.Task) -> None:
        if self._stopping.get(model_id) is stop:
            del self._stopping[model_id]


def _refusal(request_id: str, error: BaseException) -> ErrorChunk:
    """The ErrorChunk for a request whose model could not be found, started or used."""
    if isinstance(error, _not_found_types()):
        return ErrorChunk(request_id=request_id, code="model_not_found", message=str(error),
                          param="model")
    if isinstance(error, ModelUnavailable):
        return ErrorChunk(request_id=request_id, code="unavailable", message=str(error))
    if isinstance(error, ValueError):  # WrongModelTask, an empty or malformed name
        return ErrorChunk(request_id=request_id, code="invalid_request", message=str(error),
                          param="model")
    raise error
