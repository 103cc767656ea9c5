"""The node's model pool: policy over its runner registry for the instances served here.

Every model runs as an instance of the cluster state; the registry (shoal.runner.registry)
owns the runner processes. The pool decides how long an instance served by this node stays:

- each request holds its instance from the moment it is routed there to its last chunk;
- when the last request ends, a keep-alive timer starts: the request's own keep_alive_s
  (0 unloads at once, negative never), else the instance's (set when it was placed: the node
  default for a model loaded on first use, None - no expiry - for one named at start or
  placed through the API);
- when the timer runs out the pool marks the instance retiring (no new request goes there)
  and asks the cluster to delete it (`unloader`); the worker then stops its runners;
- a pinned instance never expires and is never evicted;
- to make room for another model, idle instances are evicted (eviction.py chooses which:
  least urgent latest request first, then least recently used) the same way.

Waiters for memory wake on every request's end and every unload (wait_for_change).

It also names models (names.py): a client's name -> the canonical model id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from shoal.pool.eviction import Resident
from shoal.pool.names import ModelNames, Resolver, WrongModelTask
from shoal.pool.queue import AdmissionQueue, Overloaded
from shoal.protocol import (
    EmbeddingRequest,
    EmbeddingResult,
    ErrorChunk,
    GenerationRequest,
    ImageRequest,
)
from shoal.runner.registry import RunnerRegistry
from shoal.runner.supervisor import RunnerSupervisor, RunnerUnavailable
from shoal.tracing.spans import SpanBuffer

__all__ = ["DEFAULT_KEEP_ALIVE_S", "ModelPool", "ModelUnavailable", "Resolver",
           "WrongModelTask", "refusal"]

log = logging.getLogger("shoal.pool")

# How long a model loaded on first use stays loaded after its last request, by default.
DEFAULT_KEEP_ALIVE_S = 300.0
# How long a request waits for its instance's runner to load.
DEFAULT_LOAD_WAIT_S = 600.0

Unloader = Callable[[str, str], None]  # (instance id, reason)
# None while the instance is still placed; else why its runner will never start here.
Wanted = Callable[[], str | None]


class ModelUnavailable(RuntimeError):
    """The model is known but cannot serve (loading failed, crashed too often, no room)."""


@dataclass
class _Keep:
    """Keep-alive bookkeeping of one instance served by this node."""

    default_s: float | None = None  # the instance's own keep-alive; None: no expiry
    requested_s: float | None = None  # set by the latest request that named one
    requested: bool = False
    active: int = 0  # requests holding the instance
    timer: asyncio.Task | None = None
    retiring: bool = False  # expired or evicted: being deleted, takes no new request
    pinned: bool = False
    priority: int = 5  # the latest request's
    last_used: float = 0.0  # monotonic: when a request last began or ended

    def idle_for(self) -> float | None:
        """Seconds to stay loaded once idle; None means indefinitely."""
        if self.pinned:
            return None
        value = self.requested_s if self.requested else self.default_s
        return None if value is None or value < 0 else value


@dataclass
class PoolCounts:
    """Models started and evicted on this node, by model (GET /metrics)."""

    loads: Counter[str] = field(default_factory=Counter)
    evictions: Counter[str] = field(default_factory=Counter)


class ModelPool:
    def __init__(self, registry: RunnerRegistry, resolve: Resolver | None = None,
                 keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S,
                 load_wait_s: float = DEFAULT_LOAD_WAIT_S,
                 clock: Callable[[], float] = time.time,
                 queue: AdmissionQueue | None = None, spans: SpanBuffer | None = None,
                 resolve_here: Resolver | None = None) -> None:
        if keep_alive_s is not None and keep_alive_s < 0:
            raise ValueError("keep_alive_s must be >= 0, or None to keep models loaded")
        self.registry = registry
        self.queue = queue or AdmissionQueue()  # every request's turn on this node
        self.names = ModelNames(resolve, resolve_here)
        self.keep_alive_s = keep_alive_s  # the node default for models loaded on first use
        self.load_wait_s = load_wait_s
        self._clock = clock
        self._keeps: dict[str, _Keep] = {}
        self._change: asyncio.Future[None] | None = None  # woken by _notify
        self.unloader: Unloader | None = None  # set by the cluster: deletes an instance
        self.counts = PoolCounts()
        # The node process's spans (queue and load waits, generations); runners keep theirs.
        self.spans = spans if spans is not None else SpanBuffer()

    # ---- instances served here ------------------------------------------------------------

    def track(self, instance_id: str, keep_alive_s: float | None, pinned: bool = False) -> None:
        """The instance's serving runner has started here; keep_alive_s is its own
        keep-alive. An idle instance's timer starts now."""
        if instance_id not in self._keeps:
            self.counts.loads[self._model_of(instance_id)] += 1
        keep = self._keeps.setdefault(instance_id, _Keep(last_used=time.monotonic()))
        keep.default_s = keep_alive_s
        keep.pinned = pinned
        if not keep.active:
            self._arm(instance_id, keep)

    def forget(self, instance_id: str) -> None:
        """The instance is gone from the state: drop its bookkeeping."""
        keep = self._keeps.pop(instance_id, None)
        if keep is not None and keep.timer is not None:
            keep.timer.cancel()
        self._notify()

    def is_retiring(self, instance_id: str) -> bool:
        keep = self._keeps.get(instance_id)
        return keep is not None and keep.retiring

    def unload(self, instance_id: str) -> None:
        """Unload the instance as soon as no request holds it (Ollama's keep_alive 0)."""
        keep = self._keeps.setdefault(instance_id, _Keep())
        keep.requested, keep.requested_s = True, 0.0
        if not keep.active:
            self._arm(instance_id, keep)

    def hold(self, instance_id: str, keep_alive_s: float | None, priority: int = 5) -> None:
        """A request holds the instance (no unload while held); release() lets go.
        keep_alive_s: the request's own keep-alive, if it named one."""
        keep = self._keeps.setdefault(instance_id, _Keep())
        keep.active += 1
        keep.priority = priority
        keep.last_used = time.monotonic()
        if keep.timer is not None:
            keep.timer.cancel()
            keep.timer = None
        if keep_alive_s is not None:
            keep.requested, keep.requested_s = True, keep_alive_s
        self._stamp(instance_id, None)

    def release(self, instance_id: str) -> None:
        keep = self._keeps.get(instance_id)
        if keep is None:
            return
        keep.active -= 1
        keep.last_used = time.monotonic()
        if not keep.active:
            self._arm(instance_id, keep)
        self._notify()

    # ---- eviction -------------------------------------------------------------------------

    def expiries(self) -> dict[str, float | None]:
        """Instance id -> when its keep-alive unloads it (unix seconds; None: not while in
        use, pinned or kept loaded), for every instance served here."""
        return {key[0]: s.expires_at for key, s in self.registry.items() if key[1] == 0}

    def resident_bytes(self) -> int:
        """Resident memory of every runner on this node, as they last reported it."""
        return sum(s.memory.rss_bytes or 0 for s in self.registry.supervisors
                   if s.memory is not None)

    def device_bytes(self) -> int:
        """Accelerator memory every runner on this node holds, as they last reported it."""
        return sum(s.memory.device_bytes or 0 for s in self.registry.supervisors
                   if s.memory is not None)

    def resident(self, instance_id: str, model: str, size: int,
                 busy_models: set[str]) -> Resident:
        """The instance as eviction sees it (busy: held by a request, or its model has
        requests admitted or waiting)."""
        keep = self._keeps.get(instance_id) or _Keep()
        return Resident(instance_id=instance_id, model=model, bytes=size, pinned=keep.pinned,
                        busy=keep.active > 0 or keep.retiring or model in busy_models,
                        priority=keep.priority, last_used=keep.last_used)

    def evict(self, instance_id: str, reason: str) -> None:
        """Unload an idle instance now to make room: it takes no new request."""
        keep = self._keeps.setdefault(instance_id, _Keep())
        if keep.timer is not None:
            keep.timer.cancel()
            keep.timer = None
        keep.retiring = True
        self.counts.evictions[self._model_of(instance_id)] += 1
        log.info("evicting instance %s: %s", instance_id, reason)
        if self.unloader is not None:
            self.unloader(instance_id, reason)

    async def wait_for_change(self, timeout_s: float) -> None:
        """Until a request ends or an instance is unloaded here (or timeout_s passes)."""
        if self._change is None or self._change.done():
            self._change = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, timeout_s)):
                await asyncio.shield(self._change)

    def _model_of(self, instance_id: str) -> str:
        supervisor = self.registry.get((instance_id, 0))
        return supervisor.model_id if supervisor is not None else instance_id

    def _notify(self) -> None:
        if self._change is not None and not self._change.done():
            self._change.set_result(None)
        self._change = None

    def _arm(self, instance_id: str, keep: _Keep) -> None:
        if keep.timer is not None:
            keep.timer.cancel()
            keep.timer = None
        after = keep.idle_for()
        self._stamp(instance_id, None if after is None else self._clock() + after)
        if after is not None and not keep.retiring:
            keep.timer = asyncio.get_running_loop().create_task(self._expire(instance_id, after))

    def _stamp(self, instance_id: str, expires_at: float | None) -> None:
        supervisor = self.registry.get((instance_id, 0))
        if supervisor is not None:
            supervisor.expires_at = expires_at

    async def _expire(self, instance_id: str, after_s: float) -> None:
        await asyncio.sleep(after_s)
        keep = self._keeps.get(instance_id)
        if keep is None or keep.active or keep.retiring:
            return
        keep.timer = None
        keep.retiring = True
        log.info("unloading instance %s: idle for %.0f s", instance_id, after_s)
        if self.unloader is not None:
            self.unloader(instance_id, f"idle for {after_s:.0f} s (keep-alive)")

    # ---- requests on this node's runners ---------------------------------------------------

    async def submit(self, instance_id: str, request: GenerationRequest,
                     wanted: Wanted | None = None) -> AsyncIterator[Any]:
        """request's chunks from the instance's serving runner here (rank 0), waiting for it
        to load (held meanwhile); one ErrorChunk if it cannot serve."""
        self.hold(instance_id, request.keep_alive_s, request.priority)
        try:
            try:
                supervisor = await self.serving_runner(instance_id, wanted)
            except ModelUnavailable as error:
                yield refusal(request.request_id, error)
                return
            async with contextlib.aclosing(supervisor.submit(request)) as stream:
                async for chunk in stream:
                    yield chunk
        finally:
            self.release(instance_id)

    async def submit_to(self, supervisor: RunnerSupervisor, instance_id: str,
                        request: GenerationRequest) -> AsyncIterator[Any]:
        """request's chunks from supervisor, the instance's serving runner here, which the
        caller has waited for (serving_runner); the request holds the instance meanwhile."""
        self.hold(instance_id, request.keep_alive_s, request.priority)
        try:
            async with contextlib.aclosing(supervisor.submit(request)) as stream:
                async for chunk in stream:
                    yield chunk
        finally:
            self.release(instance_id)

    async def generate_images(self, supervisor: RunnerSupervisor, instance_id: str,
                              request: ImageRequest) -> AsyncIterator[Any]:
        """request's chunks from supervisor, the image instance's runner here, which the
        caller has waited for (serving_runner); the request holds the instance meanwhile."""
        self.hold(instance_id, request.keep_alive_s, request.priority)
        try:
            async with contextlib.aclosing(supervisor.generate_images(request)) as stream:
                async for chunk in stream:
                    yield chunk
        finally:
            self.release(instance_id)

    async def submit_for_peer(self, instance_id: str, request: GenerationRequest
                              ) -> AsyncIterator[Any]:
        """A request another node accepted for an instance served here: it also waits its
        turn in this node's queue (warm: the instance is placed here), so this node's
        priority order, --parallel and client tiers cover every request its instances
        serve, wherever it arrived. An overload is the stream's one ErrorChunk."""
        queued_ns = time.time_ns()
        queue_span = {"model": request.model, "for_peer": True}
        try:
            ticket = await self.queue.admit(request.model, request.priority,
                                            request.client_id, warm=True)
        except Overloaded as error:
            self.spans.record(request.trace, "queue", queued_ns, args=queue_span)
            yield refusal(request.request_id, error)
            return
        self.spans.record(request.trace, "queue", queued_ns, args=queue_span)
        try:
            async with contextlib.aclosing(self.submit(instance_id, request)) as stream:
                async for chunk in stream:
                    yield chunk
        finally:
            self.queue.release(ticket)

    async def embed(self, supervisor: RunnerSupervisor, instance_id: str,
                    request: EmbeddingRequest) -> EmbeddingResult | ErrorChunk:
        """request's vectors from supervisor, the instance's serving runner here, which the
        caller has waited for (serving_runner); an empty batch only holds the instance."""
        self.hold(instance_id, request.keep_alive_s, request.priority)
        try:
            if request.num_inputs == 0:
                return EmbeddingResult(request_id=request.request_id, embeddings=(),
                                       prompt_tokens=0)
            return await supervisor.embed(request)
        finally:
            self.release(instance_id)

    async def serving_runner(self, instance_id: str,
                             wanted: Wanted | None = None) -> RunnerSupervisor:
        """The instance's rank-0 runner on this node once loaded (ModelUnavailable if not)."""
        try:
            return await self.registry.wait_ready((instance_id, 0), self.load_wait_s, wanted)
        except RunnerUnavailable as error:
            raise ModelUnavailable(str(error)) from error

    async def shutdown(self) -> None:
        for keep in self._keeps.values():
            if keep.timer is not None:
                keep.timer.cancel()
        await self.registry.close()


def refusal(request_id: str, error: BaseException) -> ErrorChunk:
    """The ErrorChunk for a request whose instance here could not serve it, or that could
    not wait its turn (the router maps the errors of naming a model: router/refusal.py)."""
    if isinstance(error, Overloaded):
        return ErrorChunk(request_id=request_id, code="overloaded", message=str(error),
                          retry_after_s=error.retry_after_s)
    if isinstance(error, ModelUnavailable):
        return ErrorChunk(request_id=request_id, code="unavailable", message=str(error))
    raise error
