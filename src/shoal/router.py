"""Which instance serves a request, placing one when the model has none.

Every model runs as an instance of the cluster state (one node alone is a cluster of one).
A request names a model; the router picks a live instance of it (ready ones first, then one
served here, then the least busy) or, when there is none, has the master place one, on this
node when it fits here, and waits for it. Concurrent first requests for one model share a
single placement. The request then goes to the instance's serving rank (rank 0): through
this node's pool when that rank runs here, as a task over the cluster otherwise.
Embeddings are served on this node: an embedding model is placed here.

Every request first waits its turn in the node's admission queue (pool/queue.py). A model
placed for a request goes where it fits without unloading anything (this node first), else
here after evicting idle models (pool/eviction.py), else split across nodes; when nothing
can be evicted yet the request waits (bounded) for a request to end or a model to unload.
A model named `task:NAME` is served by the first model of that fallback ladder that is
loaded, or loads within the ladder's budget (pool/ladders.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from shoal.cluster.instances import Instance, PlacementRequest
from shoal.cluster.model_facts import ModelFacts, model_facts_from_source
from shoal.cluster.service import ClusterNotReady, ClusterService, PlacementRefused
from shoal.engine.config import ModelSource, ModelTask
from shoal.pool.ladders import Ladder, task_name
from shoal.pool.pool import ModelPool, ModelUnavailable, WrongModelTask, refusal
from shoal.pool.queue import Overloaded, Ticket
from shoal.pool.room import Room, evict, room_for
from shoal.protocol import (
    EmbeddingRequest,
    EmbeddingResult,
    ErrorChunk,
    GenerationRequest,
)
from shoal.runner.supervisor import RunnerSupervisor

__all__ = ["ModelUnavailable", "Router", "WrongModelTask"]

log = logging.getLogger("shoal.router")

# How long a placement waits for the cluster to be able to place (a master, memory readings).
DEFAULT_PLACE_WAIT_S = 30.0
# How long a request for a model that does not fit yet waits for memory to free.
DEFAULT_MEMORY_WAIT_S = 300.0
_RETRY_S = 0.1
# Errors that say where the request's time went (not validation errors: those are instant).
_TIMED_CODES = ("unavailable", "timeout", "runner_crashed", "overloaded", "internal")


class UnknownTask(LookupError):
    """A request named task:NAME and no ladder is called NAME (answered like an unknown
    model: 404)."""


class Router:
    def __init__(self, pool: ModelPool, cluster: ClusterService,
                 place_wait_s: float = DEFAULT_PLACE_WAIT_S,
                 read_facts: Callable[[ModelSource], ModelFacts] = model_facts_from_source,
                 ladders: Mapping[str, Ladder] | None = None,
                 memory_wait_s: float = DEFAULT_MEMORY_WAIT_S) -> None:
        self.pool = pool
        self.cluster = cluster
        self.place_wait_s = place_wait_s
        self.queue = pool.queue
        self.ladders = dict(ladders or {})
        self.memory_wait_s = memory_wait_s
        self._read_facts = read_facts
        self._facts: dict[str, ModelFacts] = {}
        self._placing: dict[tuple[str, bool], asyncio.Task[Instance]] = {}

    @property
    def supervisors(self) -> list[RunnerSupervisor]:
        """The serving runners (rank 0 of each instance) this node runs now."""
        return [s for (_instance, rank), s in self.pool.registry.items() if rank == 0]

    # ---- requests -------------------------------------------------------------------------

    async def submit(self, request: GenerationRequest) -> AsyncIterator[Any]:
        """The request's chunks; an unknown or broken model yields one ErrorChunk."""
        clock = _Clock()
        try:
            ticket = await self._admit(request.model, "generate", request.priority,
                                       request.client_id)
        except Exception as error:  # noqa: BLE001 - refusal re-raises what it cannot map
            yield clock.explain(_refusal(request.request_id, error))
            return
        try:
            clock.queued()
            ladder = self._ladder(request.model)
            try:
                instance = await self._instance_for_request(request.model, ladder)
                if self._here(instance):
                    await self._local_runner(instance)
            except Exception as error:  # noqa: BLE001 - refusal re-raises what it cannot map
                yield clock.explain(_refusal(request.request_id, error))
                return
            clock.loaded()
            keep_alive_s = request.keep_alive_s
            if keep_alive_s is None and ladder is not None:
                keep_alive_s = ladder.keep_alive_s
            request = request.model_copy(update={
                "model": instance.model, "priority": ticket.priority,
                "keep_alive_s": keep_alive_s})
            async for chunk in self._deliver(instance, request):
                if chunk.kind == "accepted":
                    chunk = chunk.model_copy(update={"model": instance.model})
                elif chunk.kind == "error":
                    chunk = clock.explain(chunk)
                yield chunk
        finally:
            self.queue.release(ticket)

    async def _deliver(self, instance: Instance, request: GenerationRequest
                       ) -> AsyncIterator[Any]:
        if self._here(instance):
            stream = self.pool.submit(instance.instance_id, request, self._wanted(instance))
        else:
            stream = self.cluster.submit_remote(request, instance.instance_id)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult | ErrorChunk:
        """The request's vectors, or one ErrorChunk. An empty batch just loads the model."""
        clock = _Clock()
        try:
            ticket = await self._admit(request.model, "embed", request.priority,
                                       request.client_id)
        except Exception as error:  # noqa: BLE001 - refusal re-raises what it cannot map
            return clock.explain(_refusal(request.request_id, error))
        try:
            clock.queued()
            try:
                instance = await self.instance_for(request.model, "embed", here_only=True)
                await self._local_runner(instance)
            except Exception as error:  # noqa: BLE001 - refusal re-raises what it cannot map
                return clock.explain(_refusal(request.request_id, error))
            load_s = clock.loaded()
            request = request.model_copy(update={"priority": ticket.priority})
            result = await self.pool.embed(instance.instance_id, request,
                                           self._wanted(instance))
            if isinstance(result, EmbeddingResult):
                return result.model_copy(update={"load_duration_s": load_s})
            return clock.explain(result)
        finally:
            self.queue.release(ticket)

    async def _admit(self, name: str, task: ModelTask, priority: int,
                     client: str | None) -> Ticket:
        """The request's turn in the node's queue, keyed by the model it will most likely
        use (a ladder's first loaded model, else its first)."""
        ladder = self._ladder(name)
        if ladder is not None:
            model_id = next((m for m in ladder.models if self._ready_instance(m)),
                            ladder.models[0])
        else:
            model_id = await self._model_id(name, task)
        warm = self._ready_instance(model_id) is not None
        return await self.queue.admit(model_id, priority, client, warm)

    async def _model_id(self, name: str, task: ModelTask | None) -> str:
        from shoal.catalog.resolve import ModelNotFound

        try:
            model_id, _ = await self.pool.identify(name, task)
        except ModelNotFound:
            model_id = self._cluster_model_named(name)
            if model_id is None:
                raise
        return model_id

    async def load(self, name: str, keep_alive_s: float | None = None) -> bool:
        """Apply a keep-alive with no request to run (Ollama's empty request): load the model
        unless keep_alive_s is 0, which unloads a loaded model once idle. True if loaded
        afterwards (or unloading after its keep-alive)."""
        if keep_alive_s == 0:
            model_id, _ = await self.pool.identify(name)
            instances = self._live_instances(model_id)
            for instance in instances:
                if self._here(instance):
                    self.pool.unload(instance.instance_id)
                else:
                    self.cluster.delete(instance.instance_id, "unloaded by request")
            return bool(instances)
        instance = await self.instance_for(name, None)
        if self._here(instance):
            await self._local_runner(instance)
            self.pool.hold(instance.instance_id, keep_alive_s)
            self.pool.release(instance.instance_id)
        return True

    async def preload(self, names: Sequence[str], pinned: bool = False) -> None:
        """Place every named model, kept loaded (pinned: never evicted), and wait until each
        serves; raises ModelNotFound / ModelUnavailable on the first failure."""
        for name in names:
            model_id, source = await self.pool.identify(name)
            instance = await self._place(model_id, source or await self.pool.resolve(name),
                                         keep_alive_s=None, here_only=False, pinned=pinned)
            if self._here(instance):
                await self._local_runner(instance)

    def canonical_id(self, name: str) -> str:
        canonical = self.pool.canonical_id(name)
        if canonical == name:
            return self._cluster_model_named(name) or name
        return canonical

    def task_of(self, name: str) -> ModelTask | None:
        if self._ladder(name) is not None:
            return "generate"
        return self.pool.task_of(name)

    async def shutdown(self) -> None:
        for task in list(self._placing.values()):
            task.cancel()
        await self.pool.shutdown()

    # ---- ladders ----------------------------------------------------------------------------

    def _ladder(self, name: str) -> Ladder | None:
        """The ladder name asks for (task:NAME); UnknownTask if there is none by that name."""
        task = task_name(name)
        if task is None:
            return None
        ladder = self.ladders.get(task)
        if ladder is None:
            known = ", ".join(sorted(self.ladders)) or "none are configured (--tasks)"
            raise UnknownTask(f"task {task!r} not found; known tasks: {known}")
        return ladder

    async def _instance_for_request(self, name: str, ladder: Ladder | None) -> Instance:
        if ladder is None:
            return await self.instance_for(name, "generate")
        return await self._climb(ladder)

    async def _climb(self, ladder: Ladder) -> Instance:
        """The first rung with a ready instance; else the first that loads within the
        ladder's budget. pin_primary: always the first (placed pinned), however long its
        load takes."""
        if ladder.pin_primary:
            return await self._rung(ladder.models[0], ladder.keep_alive_s, pinned=True)
        for model in ladder.models:
            ready = self._ready_instance(model)
            if ready is not None:
                return ready
        deadline = time.monotonic() + ladder.budget_s
        missed = []
        for model in ladder.models:
            left = deadline - time.monotonic()
            if left <= 0:
                missed.append(f"{model}: no budget left")
                continue
            try:
                async with asyncio.timeout(left):
                    return await self._rung(model, ladder.keep_alive_s)
            except TimeoutError:
                missed.append(f"{model}: not loaded within the budget")
            except (LookupError, ModelUnavailable, ValueError) as error:
                missed.append(f"{model}: {error}")
        raise ModelUnavailable(f"task {ladder.name!r}: no model of its ladder could serve "
                               f"within {ladder.budget_s:g} s ({'; '.join(missed)})")

    async def _rung(self, model: str, keep_alive_s: float | None,
                    pinned: bool = False) -> Instance:
        instance = await self.instance_for(model, "generate", keep_alive_s=keep_alive_s,
                                           pinned=pinned)
        if self._here(instance):
            await self._local_runner(instance)
        return instance

    # ---- choosing and placing ---------------------------------------------------------------

    async def instance_for(self, name: str, task: ModelTask | None,
                           here_only: bool = False, keep_alive_s: float | None = None,
                           pinned: bool = False) -> Instance:
        """A live instance of the model name means, placed now if there is none
        (keep_alive_s: the placed instance's own, else the node default; pinned: never
        evicted).

        Raises ModelNotFound, WrongModelTask (ValueError) or ModelUnavailable."""
        from shoal.catalog.resolve import ModelNotFound

        source: ModelSource | None = None
        try:
            model_id, source = await self.pool.identify(name, task)
        except ModelNotFound:
            # Not resolvable here (a path on another machine, say): an instance of that
            # name elsewhere in the cluster can still serve it.
            model_id = self._cluster_model_named(name)
            if model_id is None or here_only:
                raise
        chosen = self._choose(model_id, here_only)
        if chosen is not None:
            return chosen
        if source is None:
            source = await self.pool.resolve(name)
        keep = self.pool.keep_alive_s if keep_alive_s is None else keep_alive_s
        return await self._place(model_id, source, keep_alive_s=keep, here_only=here_only,
                                 pinned=pinned)

    def _ready_instance(self, name: str) -> Instance | None:
        """A live instance of the model that serves now (a runner here that has loaded counts
        before the state hears of it)."""
        state = self.cluster.state
        for instance in self._live_instances(self.canonical_id(name)):
            if state.instance_status(instance.instance_id) == "ready":
                return instance
            runner = self.pool.registry.get((instance.instance_id, 0))
            if runner is not None and runner.state == "ready":
                return instance
        return None

    def _choose(self, model_id: str, here_only: bool) -> Instance | None:
        state = self.cluster.state
        candidates = []
        for instance in self._live_instances(model_id):
            here = self._here(instance)
            if here_only and not (here and len(instance.ranks) == 1):
                continue
            status = state.instance_status(instance.instance_id)
            candidates.append((status != "ready", not here,
                               len(state.tasks_of(instance.instance_id)),
                               instance.instance_id, instance))
        return min(candidates, key=lambda c: c[:4])[4] if candidates else None

    def _live_instances(self, model_id: str) -> list[Instance]:
        """Instances of the model that may take a request: not failed, not retiring, their
        serving node reachable."""
        state, peers = self.cluster.state, self.cluster.peers
        out = []
        for instance in state.instances_of(model_id):
            server = instance.ranks[0].node_id
            if server != self.cluster.node_id and server not in peers:
                continue
            if (self.pool.is_retiring(instance.instance_id)
                    or state.instance_status(instance.instance_id) == "failed"):
                continue
            out.append(instance)
        return out

    async def _place(self, model_id: str, source: ModelSource, keep_alive_s: float | None,
                     here_only: bool, pinned: bool = False) -> Instance:
        """Have the master place the model (one placement for concurrent callers)."""
        key = (model_id, here_only)
        task = self._placing.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                self._place_once(model_id, source, keep_alive_s, here_only, pinned))
            self._placing[key] = task
            task.add_done_callback(lambda _t: self._placing.pop(key, None))
        return await asyncio.shield(task)

    async def _place_once(self, model_id: str, source: ModelSource, keep_alive_s: float | None,
                          here_only: bool, pinned: bool) -> Instance:
        """Whole where it fits as things stand (here first); else here after evicting idle
        models; else split across nodes; else wait for memory to free (bounded)."""
        facts = await self._facts_of(model_id, source)
        others = tuple(n for n in self.cluster.state.nodes if n != self.cluster.node_id)
        whole = PlacementRequest(
            facts=facts, preferred_node=self.cluster.node_id, keep_alive_s=keep_alive_s,
            on_demand=True, pinned=pinned, sharding="single",
            excluded_nodes=others if here_only else ())
        deadline = time.monotonic() + self.memory_wait_s
        while True:
            placed = await self._try_place(whole)
            if isinstance(placed, Instance):
                return placed
            room = room_for(self.cluster, self.pool, facts, self.queue.busy_models())
            if room.victims:
                await evict(self.cluster, self.pool, room, model_id)
                continue
            if not here_only and len(self.cluster.state.nodes) > 1:
                split = await self._try_place(whole.model_copy(update={"sharding": "auto"}))
                if isinstance(split, Instance):
                    return split
                placed = split
            left = deadline - time.monotonic()
            if room.budget is None or room.never is not None or left <= 0:
                raise ModelUnavailable(_no_room(room, placed, self.memory_wait_s, left <= 0))
            # Busy or pinned models hold the memory: wait for a request to end or a model to
            # unload. When this node's count says it fits but the master refused, its view
            # is a moment ahead or behind: look again shortly.
            await self.pool.wait_for_change(left if room.blocked else min(left, 1.0))

    async def _try_place(self, request: PlacementRequest) -> Instance | str:
        """The placed instance, or why the master refused it."""
        deadline = time.monotonic() + self.place_wait_s
        while True:
            try:
                instance = await self.cluster.place(request)
                log.info("placed %s as %s on %s", request.model, instance.instance_id,
                         ", ".join(instance.node_ids))
                return instance
            except PlacementRefused as error:
                return str(error)
            except ClusterNotReady as error:
                if time.monotonic() >= deadline:
                    raise ModelUnavailable(f"cannot place model {request.model!r}: "
                                           f"{error}") from error
            await asyncio.sleep(_RETRY_S)

    async def _facts_of(self, model_id: str, source: ModelSource) -> ModelFacts:
        facts = self._facts.get(model_id)
        if facts is None:
            try:
                facts = await asyncio.to_thread(self._read_facts, source)
            except (OSError, ValueError) as error:
                raise ModelUnavailable(f"cannot read model {model_id!r}: {error}") from error
            self._facts[model_id] = facts
        return facts

    async def _local_runner(self, instance: Instance) -> RunnerSupervisor:
        """The instance's serving runner here, once loaded (ModelUnavailable if not)."""
        return await self.pool.serving_runner(instance.instance_id, self._wanted(instance))

    def _wanted(self, instance: Instance) -> Callable[[], str | None]:
        def gone() -> str | None:
            if instance.instance_id in self.cluster.state.instances:
                return None
            reason = self.cluster.deletion_reason(instance.instance_id)
            return f"model {instance.model!r} cannot serve: {reason or 'it was unloaded'}"
        return gone

    def _here(self, instance: Instance) -> bool:
        return instance.ranks[0].node_id == self.cluster.node_id

    def _cluster_model_named(self, name: str) -> str | None:
        wanted = name.lower()
        for instance in self.cluster.state.instances.values():
            if instance.model.lower() == wanted:
                return instance.model
        return None


def _no_room(room: Room, refused: str, waited_s: float, timed_out: bool) -> str:
    """Why a model could not be placed: the sizes, the budget and what holds it."""
    if room.never is not None:
        return f"{room.never}; {refused}" if room.never not in refused else room.never
    if room.blocked is not None:
        after = f"; waited {waited_s:.0f} s for memory to free" if timed_out else ""
        return f"{room.blocked}{after}"
    return refused


def _refusal(request_id: str, error: BaseException) -> ErrorChunk:
    if isinstance(error, Overloaded):
        return ErrorChunk(request_id=request_id, code="overloaded", message=str(error),
                          retry_after_s=error.retry_after_s)
    if isinstance(error, UnknownTask):
        return ErrorChunk(request_id=request_id, code="model_not_found", message=str(error),
                          param="model")
    return refusal(request_id, error)


class _Clock:
    """Where a request's time went: waiting in the queue, loading its model, generating."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._queued: float | None = None
        self._loaded: float | None = None

    def queued(self) -> float:
        self._queued = time.monotonic()
        return self._queued - self._start

    def loaded(self) -> float:
        self._loaded = time.monotonic()
        return self._loaded - (self._queued or self._start)

    def explain(self, chunk: ErrorChunk) -> ErrorChunk:
        """chunk, its message ending with the time spent in each stage so far."""
        if chunk.code not in _TIMED_CODES:
            return chunk
        now = time.monotonic()
        queued = (self._queued or now) - self._start
        parts = [f"queue {queued:.1f} s"]
        if self._queued is not None:
            parts.append(f"load {(self._loaded or now) - self._queued:.1f} s")
        if self._loaded is not None:
            parts.append(f"generation {now - self._loaded:.1f} s")
        return chunk.model_copy(update={"message": f"{chunk.message} (time: "
                                                   f"{', '.join(parts)})"})
