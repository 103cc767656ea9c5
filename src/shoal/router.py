"""Which instance serves a request, placing one when the model has none.

Every model runs as an instance of the cluster state (one node alone is a cluster of one).
A request names a model; the router picks a live instance of it (ready ones first, then one
served here, then the least busy) or, when there is none, has the master place one, on this
node when it fits here, and waits for it. Concurrent first requests for one model share a
single placement. The request then goes to the instance's serving rank (rank 0): through
this node's pool when that rank runs here, as a task over the cluster otherwise.
Embeddings are served on this node: an embedding model is placed here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from shoal.cluster.instances import Instance, PlacementRequest
from shoal.cluster.model_facts import ModelFacts, model_facts_from_source
from shoal.cluster.service import ClusterNotReady, ClusterService, PlacementRefused
from shoal.engine.config import ModelSource, ModelTask
from shoal.pool.pool import ModelPool, ModelUnavailable, WrongModelTask, refusal
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
_RETRY_S = 0.1


class Router:
    def __init__(self, pool: ModelPool, cluster: ClusterService,
                 place_wait_s: float = DEFAULT_PLACE_WAIT_S,
                 read_facts: Callable[[ModelSource], ModelFacts] = model_facts_from_source,
                 ) -> None:
        self.pool = pool
        self.cluster = cluster
        self.place_wait_s = place_wait_s
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
        try:
            instance = await self.instance_for(request.model, "generate")
        except Exception as error:  # noqa: BLE001 - refusal re-raises what it cannot map
            yield refusal(request.request_id, error)
            return
        request = request.model_copy(update={"model": instance.model})
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
        started = time.monotonic()
        try:
            instance = await self.instance_for(request.model, "embed", here_only=True)
            await self._local_runner(instance)
        except Exception as error:  # noqa: BLE001 - refusal re-raises what it cannot map
            return refusal(request.request_id, error)
        load_s = time.monotonic() - started
        result = await self.pool.embed(instance.instance_id, request, self._wanted(instance))
        if isinstance(result, EmbeddingResult):
            return result.model_copy(update={"load_duration_s": load_s})
        return result

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

    async def preload(self, names: Sequence[str]) -> None:
        """Place every named model here, kept loaded, and wait until each serves; raises
        ModelNotFound / ModelUnavailable on the first failure."""
        for name in names:
            model_id, source = await self.pool.identify(name)
            instance = await self._place(model_id, source or await self.pool.resolve(name),
                                         keep_alive_s=None, here_only=False)
            if self._here(instance):
                await self._local_runner(instance)

    def canonical_id(self, name: str) -> str:
        canonical = self.pool.canonical_id(name)
        if canonical == name:
            return self._cluster_model_named(name) or name
        return canonical

    def task_of(self, name: str) -> ModelTask | None:
        return self.pool.task_of(name)

    async def shutdown(self) -> None:
        for task in list(self._placing.values()):
            task.cancel()
        await self.pool.shutdown()

    # ---- choosing and placing ---------------------------------------------------------------

    async def instance_for(self, name: str, task: ModelTask | None,
                           here_only: bool = False) -> Instance:
        """A live instance of the model name means, placed now if there is none.

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
        return await self._place(model_id, source, keep_alive_s=self.pool.keep_alive_s,
                                 here_only=here_only)

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
                     here_only: bool) -> Instance:
        """Have the master place the model (one placement for concurrent callers)."""
        key = (model_id, here_only)
        task = self._placing.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                self._place_once(model_id, source, keep_alive_s, here_only))
            self._placing[key] = task
            task.add_done_callback(lambda _t: self._placing.pop(key, None))
        return await asyncio.shield(task)

    async def _place_once(self, model_id: str, source: ModelSource,
                          keep_alive_s: float | None, here_only: bool) -> Instance:
        facts = await self._facts_of(model_id, source)
        others = tuple(n for n in self.cluster.state.nodes if n != self.cluster.node_id)
        request = PlacementRequest(
            facts=facts, preferred_node=self.cluster.node_id, keep_alive_s=keep_alive_s,
            on_demand=True, sharding="single" if here_only else "auto",
            excluded_nodes=others if here_only else ())
        deadline = time.monotonic() + self.place_wait_s
        while True:
            try:
                instance = await self.cluster.place(request)
                log.info("placed %s as %s on %s", model_id, instance.instance_id,
                         ", ".join(instance.node_ids))
                return instance
            except PlacementRefused as error:
                raise ModelUnavailable(str(error)) from error
            except ClusterNotReady as error:
                if time.monotonic() >= deadline:
                    raise ModelUnavailable(f"cannot place model {model_id!r}: {error}") from error
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
