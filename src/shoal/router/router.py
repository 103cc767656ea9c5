"""Which instance serves a request, placing one when the model has none.

Every model runs as an instance of the cluster state (one node alone is a cluster of one).
A request names a model; the router picks a live instance of it (ready ones first, then one
served here, then the least busy) or, when there is none, has the master place one, on this
node when it fits here, and waits for it. Concurrent first requests for one model share a
single placement. The request then goes to the instance's serving rank (rank 0): through
this node's pool when that rank runs here, as a task over the cluster otherwise.
Embeddings and images are served on this node: an embedding or image model is placed here.

Every request first waits its turn in the node's admission queue (pool/queue.py). The name
it gives is worked out once, when it joins the queue (naming.py). A model placed for a
request goes where it fits without unloading anything (this node first), else here after
evicting idle models, else split across nodes (placer.py). A model named `task:NAME` is served by the first model of that
fallback ladder that is loaded, or loads within the ladder's budget (ladders.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from shoal.cluster.instances import Instance
from shoal.cluster.service import ClusterService
from shoal.engine.config import ModelTask
from shoal.metrics import NodeMetrics
from shoal.pool.names import WrongModelTask
from shoal.pool.pool import ModelPool, ModelUnavailable
from shoal.pool.queue import Ticket
from shoal.protocol import (
    EmbeddingRequest,
    EmbeddingResult,
    ErrorChunk,
    GenerationRequest,
    ImageRequest,
)
from shoal.router.cancellable import CancellableStream
from shoal.router.chooser import InstanceChooser
from shoal.router.clock import RequestClock
from shoal.router.ladders import Ladder
from shoal.router.naming import Named, Naming
from shoal.router.placer import Placer
from shoal.router.refusal import refusal
from shoal.router.relay import Relay
from shoal.runner.supervisor import RunnerSupervisor

__all__ = ["ModelUnavailable", "Router", "WrongModelTask"]

log = logging.getLogger("shoal.router")

# Finding a loaded instance takes microseconds; a longer wait was a placement or a load.
_LOAD_SPAN_MIN_NS = 1_000_000
# Requests one model runs at once, by task, where fewer than the queue's --parallel: a
# diffusers pipeline draws one request at a time, so the rest wait their turn in the queue.
_SLOTS_BY_TASK: dict[ModelTask, int] = {"image": 1}


def _retry_of(request: GenerationRequest) -> GenerationRequest:
    """The request as its single retry sends it: a new id, so no node mistakes it for the
    first attempt (chunks go back to the client under the original id)."""
    return request.model_copy(update={"request_id": f"{request.request_id}~retry"})


class Router:
    def __init__(self, pool: ModelPool, cluster: ClusterService,
                 ladders: Mapping[str, Ladder] | None = None, **placing: Any) -> None:
        """placing: Placer's options (place_wait_s, memory_wait_s, read_facts)."""
        self.pool = pool
        self.cluster = cluster
        self.queue = pool.queue
        self.placer = Placer(pool, cluster, **placing)
        self.chooser = InstanceChooser(pool, cluster)
        self.naming = Naming(pool.names, self.chooser, ladders or {})
        self._in_flight: dict[str, CancellableStream] = {}  # request id -> its stream
        self.metrics = NodeMetrics()  # GET /metrics
        self.spans = pool.spans  # the node process's spans (GET /v1/traces/{id})
        self.metrics.watch(self)

    @property
    def supervisors(self) -> list[RunnerSupervisor]:
        """The serving runners (rank 0 of each instance) this node runs now."""
        return [s for (_instance, rank), s in self.pool.registry.items() if rank == 0]

    # ---- requests -------------------------------------------------------------------------

    async def submit(self, request: GenerationRequest) -> AsyncIterator[Any]:
        """The request's chunks; an unknown or broken model yields one ErrorChunk. cancel()
        ends it, wherever it is (queued, loading, generating here or on another node)."""
        observer = self.metrics.observe(request.model)
        async with contextlib.aclosing(self._cancellable(self._submit(request),
                                                         request.request_id)) as chunks:
            async for chunk in chunks:
                observer.chunk(chunk)
                yield chunk

    async def _cancellable(self, chunks: AsyncIterator[Any], request_id: str
                           ) -> AsyncIterator[Any]:
        """chunks, which cancel(request_id) ends while they run."""
        stream = CancellableStream(chunks, request_id)
        self._in_flight[request_id] = stream
        try:
            async for chunk in stream:
                yield chunk
        finally:
            if self._in_flight.get(request_id) is stream:
                del self._in_flight[request_id]
            await stream.close()

    def cancel(self, request_id: str) -> bool:
        """End a generation or image request accepted by this node; False if there is none
        such."""
        stream = self._in_flight.get(request_id)
        return stream is not None and stream.cancel()

    async def _submit(self, request: GenerationRequest) -> AsyncIterator[Any]:
        clock = RequestClock()
        turn = await self._turn(request, "generate", clock)
        if isinstance(turn, ErrorChunk):
            yield turn
            return
        ticket, named = turn
        try:
            clock.queued()
            relay = Relay(request.request_id)  # what of each attempt the client sees
            avoid: str | None = None  # the instance a first attempt lost
            for attempt in (request, _retry_of(request)):
                placing_ns = time.time_ns()
                try:
                    instance, runner = await self._serving(attempt, named, avoid)
                    if instance.model != ticket.model:  # a ladder fell back to another rung
                        ticket = await self._requeue(ticket, instance.model)
                except Exception as error:  # noqa: BLE001 - refusal re-raises what it cannot map
                    self._record_load(request, placing_ns, None)
                    yield clock.explain(refusal(request.request_id, error))
                    return
                self._record_load(request, placing_ns, instance)
                clock.loaded()
                lost: ErrorChunk | None = None
                async with contextlib.aclosing(self._attempt(
                        attempt, named, ticket, instance, runner, clock)) as chunks:
                    async for chunk in chunks:
                        if relay.lost(chunk, retry_left=avoid is None):
                            lost = chunk
                            break
                        for passed in relay.pass_on(chunk):
                            yield passed
                if lost is None:
                    return
                relay.drop_attempt()
                log.info("request %s lost instance %s before its first token (%s); retrying "
                         "it once elsewhere", request.request_id, instance.instance_id,
                         lost.message)
                avoid = instance.instance_id
        finally:
            self.queue.release(ticket)

    async def _attempt(self, request: GenerationRequest, named: Named | Ladder,
                       ticket: Ticket, instance: Instance, runner: RunnerSupervisor | None,
                       clock: RequestClock) -> AsyncIterator[Any]:
        """One delivery of request to instance: its chunks, errors explained by the clock."""
        keep_alive_s = request.keep_alive_s
        if keep_alive_s is None and isinstance(named, Ladder):
            keep_alive_s = named.keep_alive_s
        request = request.model_copy(update={
            "model": instance.model, "priority": ticket.priority, "keep_alive_s": keep_alive_s})
        delivered_ns = time.time_ns()
        try:
            async with contextlib.aclosing(self._deliver(instance, runner, request)) as stream:
                async for chunk in stream:
                    if chunk.kind == "accepted":
                        chunk = chunk.model_copy(update={"model": instance.model})
                    elif chunk.kind == "error":
                        chunk = clock.explain(chunk)
                    yield chunk
        finally:
            self.spans.record(request.trace, "generate" if runner else "remote",
                              delivered_ns, args={"instance": instance.instance_id,
                                                  "node": instance.ranks[0].node_id})

    def _deliver(self, instance: Instance, runner: RunnerSupervisor | None,
                 request: GenerationRequest) -> AsyncIterator[Any]:
        """The request's chunks from the instance's serving rank: through the pool when it
        runs here (runner), as a cluster task otherwise."""
        if runner is not None:
            return self.pool.submit_to(runner, instance.instance_id, request)
        return self.cluster.submit_remote(request, instance.instance_id)

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult | ErrorChunk:
        """The request's vectors, or one ErrorChunk. An empty batch just loads the model."""
        clock = RequestClock()
        turn = await self._turn(request, "embed", clock)
        if isinstance(turn, ErrorChunk):
            return turn
        ticket, named = turn
        try:
            clock.queued()
            served = await self._served_here(request, named, "embed", clock)
            if isinstance(served, ErrorChunk):
                return served
            instance, runner = served
            load_s = clock.loaded()
            request = request.model_copy(update={"priority": ticket.priority})
            embedding_ns = time.time_ns()
            result = await self.pool.embed(runner, instance.instance_id, request)
            self.spans.record(request.trace, "embed", embedding_ns,
                              args={"instance": instance.instance_id,
                                    "inputs": request.num_inputs})
            if isinstance(result, EmbeddingResult):
                return result.model_copy(update={"load_duration_s": load_s})
            return clock.explain(result)
        finally:
            self.queue.release(ticket)

    async def _served_here(self, request: EmbeddingRequest | ImageRequest,
                           named: Named | Ladder, task: ModelTask, clock: RequestClock
                           ) -> tuple[Instance, RunnerSupervisor] | ErrorChunk:
        """An instance served whole on this node for an embedding or image request, and its
        loaded runner; or the ErrorChunk that says why not (its load recorded either way)."""
        placing_ns = time.time_ns()
        try:
            if isinstance(named, Ladder):  # ladders hold text models: look the name up
                named = await self.naming.identify(request.model, task)
            instance = await self._instance_of(request.model, named, here_only=True)
            runner = await self._local_runner(instance)
        except Exception as error:  # noqa: BLE001 - refusal re-raises what it cannot map
            self._record_load(request, placing_ns, None)
            return clock.explain(refusal(request.request_id, error))
        self._record_load(request, placing_ns, instance)
        return instance, runner

    async def generate_images(self, request: ImageRequest) -> AsyncIterator[Any]:
        """The request's image chunks (ImagesDone last), or one ErrorChunk. The model's one
        pipeline draws one request at a time: the others wait in the queue, in its order.
        cancel() ends it, wherever it is."""
        async with contextlib.aclosing(self._cancellable(self._generate_images(request),
                                                         request.request_id)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _generate_images(self, request: ImageRequest) -> AsyncIterator[Any]:
        clock = RequestClock()
        turn = await self._turn(request, "image", clock)
        if isinstance(turn, ErrorChunk):
            yield turn
            return
        ticket, named = turn
        try:
            clock.queued()
            served = await self._served_here(request, named, "image", clock)
            if isinstance(served, ErrorChunk):
                yield served
                return
            instance, runner = served
            clock.loaded()
            request = request.model_copy(update={"priority": ticket.priority})
            drawing_ns = time.time_ns()
            try:
                async with contextlib.aclosing(self.pool.generate_images(
                        runner, instance.instance_id, request)) as stream:
                    async for chunk in stream:
                        yield clock.explain(chunk) if chunk.kind == "error" else chunk
            finally:
                self.spans.record(request.trace, "images", drawing_ns,
                                  args={"instance": instance.instance_id, "n": request.n})
        finally:
            self.queue.release(ticket)

    async def _turn(self, request: GenerationRequest | EmbeddingRequest | ImageRequest,
                    task: ModelTask,
                    clock: RequestClock) -> tuple[Ticket, Named | Ladder] | ErrorChunk:
        """The request's slot once its turn comes and what its model name names (a model,
        or a ladder of them), or the ErrorChunk that refuses it."""
        queued_ns = time.time_ns()
        try:
            return await self._admit(request.model, task, request.priority,
                                     request.client_id)
        except Exception as error:  # noqa: BLE001 - refusal re-raises what it cannot map
            return clock.explain(refusal(request.request_id, error))
        finally:
            self.spans.record(request.trace, "queue", queued_ns,
                              args={"model": request.model, "priority": request.priority})

    def _record_load(self, request: GenerationRequest | EmbeddingRequest | ImageRequest,
                     since_ns: int, instance: Instance | None) -> None:
        """The wait for an instance to serve the request, when there was one to speak of
        (a placement, a load): a request for a loaded model has no load span."""
        if time.time_ns() - since_ns < _LOAD_SPAN_MIN_NS and instance is not None:
            return
        self.spans.record(request.trace, "load", since_ns, args={
            "model": request.model, "instance": instance.instance_id if instance else None})

    async def _admit(self, name: str, task: ModelTask, priority: int,
                     client: str | None) -> tuple[Ticket, Named | Ladder]:
        """The request's turn in the node's queue, keyed by the model it will most likely
        use (a ladder's first loaded model, else its first), and what name names (the
        rungs of a ladder are named as they are tried)."""
        named = await self.naming.name(name, task)
        if isinstance(named, Ladder):
            model_id = next((m for m in named.models if self._ready_instance(m)),
                            named.models[0])
        else:
            model_id = named.model_id
        warm = self._ready_instance(model_id) is not None
        slots = _SLOTS_BY_TASK.get(task)
        return await self.queue.admit(model_id, priority, client, warm, slots), named

    async def _requeue(self, ticket: Ticket, model_id: str) -> Ticket:
        """A turn keyed by the model that will really serve (its --parallel applies), in
        place of ticket's; warm, since that model is already chosen."""
        self.queue.release(ticket)
        return await self.queue.admit(model_id, ticket.priority, ticket.client, warm=True)

    async def load(self, name: str, keep_alive_s: float | None = None) -> bool:
        """Apply a keep-alive with no request to run (Ollama's empty request): load the model
        unless keep_alive_s is 0, which unloads a loaded model once idle. True if loaded
        afterwards (or unloading after its keep-alive)."""
        if keep_alive_s == 0:
            model_id, _ = await self.naming.names.identify(name)
            instances = self.chooser.live(model_id)
            for instance in instances:
                if self.chooser.here(instance):
                    self.pool.unload(instance.instance_id)
                else:
                    self.cluster.delete(instance.instance_id, "unloaded by request")
            return bool(instances)
        instance = await self.instance_for(name, None)
        if self.chooser.here(instance):
            await self._local_runner(instance)
            self.pool.hold(instance.instance_id, keep_alive_s)
            self.pool.release(instance.instance_id)
        return True

    async def preload(self, names: Sequence[str], pinned: bool = False) -> None:
        """Place every named model, kept loaded (pinned: never evicted), and wait until each
        serves; raises ModelNotFound / ModelUnavailable on the first failure."""
        model_names = self.naming.names
        for name in names:
            model_id, source = await model_names.identify(name)
            instance = await self.placer.place(model_id,
                                               source or await model_names.resolve(name),
                                               keep_alive_s=None, here_only=False,
                                               pinned=pinned)
            if self.chooser.here(instance):
                await self._local_runner(instance)

    def canonical_id(self, name: str) -> str:
        return self.naming.canonical_id(name)

    def task_of(self, name: str) -> ModelTask | None:
        return self.naming.task_of(name)

    async def shutdown(self) -> None:
        self.placer.cancel()
        await self.pool.shutdown()

    # ---- the instance and runner that serve a request ---------------------------------------

    async def _serving(self, request: GenerationRequest, named: Named | Ladder,
                       avoid: str | None = None) -> tuple[Instance, RunnerSupervisor | None]:
        """The instance that serves request, and its serving runner once loaded when that
        runs here (None: on another node); the request's session goes there from now on.
        avoid: an instance chosen only when no other of the model is live (a retry's)."""
        if isinstance(named, Ladder):
            instance, runner = await self._climb(named)
            self.chooser.pin_session(request, instance)
            return instance, runner
        instance = await self._instance_of(request.model, named, request=request, avoid=avoid)
        self.chooser.pin_session(request, instance)
        return instance, await self._runner_here(instance)

    async def _climb(self, ladder: Ladder) -> tuple[Instance, RunnerSupervisor | None]:
        """The first rung with a ready instance; else the first that loads within the
        ladder's budget. pin_primary: always the first (placed pinned), however long its
        load takes. With the rung's serving runner, as _serving."""
        if ladder.pin_primary:
            return await self._rung(ladder.models[0], ladder.keep_alive_s, pinned=True)
        for model in ladder.models:
            ready = self._ready_instance(model)
            if ready is not None:
                return ready, await self._runner_here(ready)
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

    async def _rung(self, model: str, keep_alive_s: float | None, pinned: bool = False
                    ) -> tuple[Instance, RunnerSupervisor | None]:
        instance = await self.instance_for(model, "generate", keep_alive_s=keep_alive_s,
                                           pinned=pinned)
        return instance, await self._runner_here(instance)

    # ---- choosing and placing ---------------------------------------------------------------

    async def instance_for(self, name: str, task: ModelTask | None,
                           here_only: bool = False, keep_alive_s: float | None = None,
                           pinned: bool = False,
                           request: GenerationRequest | None = None) -> Instance:
        """A live instance of the model name means, placed now if there is none
        (keep_alive_s: the placed instance's own, else the node default; pinned: never
        evicted; request: the generation request it is for, whose session and prompt prefix
        prefer the instance holding its KV).

        Raises ModelNotFound, WrongModelTask (ValueError) or ModelUnavailable."""
        named = await self.naming.identify(name, task)
        return await self._instance_of(name, named, here_only, keep_alive_s, pinned, request)

    async def _instance_of(self, name: str, named: Named, here_only: bool = False,
                           keep_alive_s: float | None = None, pinned: bool = False,
                           request: GenerationRequest | None = None,
                           avoid: str | None = None) -> Instance:
        """instance_for, with name already identified as named."""
        if named.not_found is not None and here_only:
            raise named.not_found  # only another node knows the name
        chosen = self.chooser.choose(named.model_id, here_only, request, avoid)
        if chosen is not None:
            return chosen
        # Placing: the name as resolved for this request, else looked up afresh.
        if named.source is None:
            source = await self.naming.names.resolve(name)
            # Another request may have placed the model while this one looked it up (the
            # placer shares a placement only while it runs): take that instance.
            chosen = self.chooser.choose(named.model_id, here_only, request, avoid)
            if chosen is not None:
                return chosen
        else:
            source = named.source
        keep = self.pool.keep_alive_s if keep_alive_s is None else keep_alive_s
        return await self.placer.place(named.model_id, source, keep_alive_s=keep,
                                       here_only=here_only, pinned=pinned)

    def _ready_instance(self, name: str) -> Instance | None:
        return self.chooser.ready(self.canonical_id(name))

    async def _local_runner(self, instance: Instance) -> RunnerSupervisor:
        """The instance's serving runner here, once loaded (ModelUnavailable if not)."""
        return await self.pool.serving_runner(instance.instance_id, self._wanted(instance))

    async def _runner_here(self, instance: Instance) -> RunnerSupervisor | None:
        """_local_runner when the instance's serving rank runs here; None otherwise."""
        if not self.chooser.here(instance):
            return None
        return await self._local_runner(instance)

    def _wanted(self, instance: Instance) -> Callable[[], str | None]:
        def gone() -> str | None:
            if instance.instance_id in self.cluster.state.instances:
                return None
            reason = self.cluster.deletion_reason(instance.instance_id)
            return f"model {instance.model!r} cannot serve: {reason or 'it was unloaded'}"
        return gone
