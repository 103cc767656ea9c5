"""Placing a model for requests that found no instance of it.

One placement per model at a time, however many requests wait for it. The model goes whole
where it fits as things stand (the asking node first); else on the asking node after
evicting idle models there (room.py); else split across nodes; else the requests wait for
memory to free (a request ending, a model unloading), up to memory_wait_s, and are told what
holds it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from shoal.backend_names import DEFAULT_BACKEND, BackendName
from shoal.cluster.backends import BackendChoiceError, choose_backend
from shoal.cluster.instances import Instance, PlacementRequest
from shoal.cluster.model_facts import ModelFacts, model_facts_from_source
from shoal.cluster.service import ClusterNotReady, ClusterService, NoQuorum, PlacementRefused
from shoal.engine.config import ModelSource
from shoal.pool.pool import ModelPool, ModelUnavailable
from shoal.router.room import Room, evict, room_for

log = logging.getLogger("shoal.router")

# How long a placement waits for the cluster to be able to place (a master, memory readings).
DEFAULT_PLACE_WAIT_S = 30.0
# How long a request for a model that does not fit yet waits for memory to free.
DEFAULT_MEMORY_WAIT_S = 300.0
_RETRY_S = 0.1


class Placer:
    def __init__(self, pool: ModelPool, cluster: ClusterService,
                 place_wait_s: float = DEFAULT_PLACE_WAIT_S,
                 memory_wait_s: float = DEFAULT_MEMORY_WAIT_S,
                 read_facts: Callable[[ModelSource], ModelFacts] = model_facts_from_source,
                 backend_of: Callable[[str], BackendName | None] = lambda _model: None,
                 ) -> None:
        self.pool = pool
        self.cluster = cluster
        self.place_wait_s = place_wait_s
        self.memory_wait_s = memory_wait_s
        self._read_facts = read_facts
        # The backend the node assigns a model (--backend, its card); None: the default.
        self.backend_of = backend_of
        self._facts: dict[str, ModelFacts] = {}
        self._placing: dict[tuple[str, bool], asyncio.Task[Instance]] = {}

    def cancel(self) -> None:
        for task in list(self._placing.values()):
            task.cancel()

    async def place(self, model_id: str, source: ModelSource, keep_alive_s: float | None,
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
        running = self.cluster.backends_running()
        try:
            backend = choose_backend(facts, source.format, self.backend_of(model_id), running)
        except BackendChoiceError as error:
            raise ModelUnavailable(str(error)) from error
        facts = self.cluster.with_measured_size(facts, source, backend)
        if backend not in running:  # waiting for memory would not help
            raise ModelUnavailable(f"model {model_id!r} is to be served by {backend}, which "
                                   f"no node of the cluster runs")
        others = tuple(n for n in self.cluster.state.nodes if n != self.cluster.node_id)
        whole = PlacementRequest(
            facts=facts, preferred_node=self.cluster.node_id, keep_alive_s=keep_alive_s,
            on_demand=True, pinned=pinned, sharding="single", backend=backend,
            excluded_nodes=others if here_only else ())
        # Evicting here makes room only for a backend this node runs.
        runs_here = backend == DEFAULT_BACKEND or backend in self.pool.registry.backends
        deadline = time.monotonic() + self.memory_wait_s
        while True:
            placed = await self._try_place(whole)
            if isinstance(placed, Instance):
                return placed
            room = room_for(self.cluster, self.pool, facts, self.pool.queue.busy_models(),
                            backend)
            if room.victims and runs_here:
                await evict(self.cluster, self.pool, room, model_id)
                continue
            if not here_only and len(self.cluster.state.nodes) > 1:
                split = await self._try_place(whole.model_copy(update={"sharding": "auto"}))
                if isinstance(split, Instance):
                    return split
                placed = split
            left = deadline - time.monotonic()
            if room.budget is None or room.never is not None or left <= 0:
                raise ModelUnavailable(no_room(room, placed, self.memory_wait_s, left <= 0))
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
            except NoQuorum as error:  # a partition: not a wait of seconds
                raise ModelUnavailable(f"cannot place model {request.model!r}: "
                                       f"{error}") from error
            except ClusterNotReady as error:
                if time.monotonic() >= deadline:
                    raise ModelUnavailable(f"cannot place model {request.model!r}: "
                                           f"{error}") from error
            await asyncio.sleep(_RETRY_S)

    async def _facts_of(self, model_id: str, source: ModelSource) -> ModelFacts:
        """The model's facts from its headers (read once); what it held when it last loaded
        here is added once its backend is known (that replaces placement's estimate)."""
        facts = self._facts.get(model_id)
        if facts is None:
            try:
                facts = await asyncio.to_thread(self._read_facts, source)
            except (OSError, ValueError) as error:
                raise ModelUnavailable(f"cannot read model {model_id!r}: {error}") from error
            self._facts[model_id] = facts
        return facts



def no_room(room: Room, refused: str, waited_s: float, timed_out: bool) -> str:
    """Why a model could not be placed: the sizes, the budget and what holds it."""
    if room.never is not None:
        return f"{room.never}; {refused}" if room.never not in refused else room.never
    if room.blocked is not None:
        after = f"; waited {waited_s:.0f} s for memory to free" if timed_out else ""
        return f"{room.blocked}{after}"
    return refused
