"""The node's own models in the cluster state: each runner the pool started by itself
(preloaded, or loaded on first use) is listed as a local instance, and deleted once the pool
has unloaded it.

A local instance names the pool generation it mirrors, so a runner started again after an
unload is a new instance, never confused with the old one. Commands may be lost (a master
dying between receipt and indexing): what still differs after `resend_s` is sent again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from typing import Any

from shoal.cluster.background import cancel_and_wait
from shoal.cluster.events import AdoptInstance, Command, DeleteInstance
from shoal.cluster.instances import Instance, PlacementRequest, Rank
from shoal.cluster.model_facts import ModelFacts
from shoal.cluster.state import ClusterState
from shoal.ids import InstanceId, NodeId, new_command_id, runner_id_for
from shoal.pool.pool import Residency

log = logging.getLogger("shoal.cluster.worker")


def local_instance_id(node_id: NodeId, model_id: str, generation: int) -> InstanceId:
    """A local instance's id, derived so that repeating AdoptInstance is harmless."""
    digest = hashlib.sha256(f"{node_id}\0{model_id}\0{generation}".encode()).hexdigest()
    return InstanceId(f"inst-{digest[:16]}")


class PoolMirror:
    def __init__(self, node_id: NodeId, send_command: Callable[[Command], None],
                 source_of: Callable[[str], Any], read_facts: Callable[[Any], ModelFacts],
                 wake: Callable[[], None]) -> None:
        """source_of(model_id): where a running model's weights are; read_facts(source): its
        ModelFacts (reads the weight file's header, so it runs in a thread)."""
        self.node_id = node_id
        self._send = send_command
        self._source_of = source_of
        self._read_facts = read_facts
        self._wake = wake
        self._facts: dict[str, ModelFacts | None] = {}
        self._jobs: dict[str, asyncio.Task] = {}

    async def close(self) -> None:
        await cancel_and_wait(self._jobs.values())

    def reconcile(self, state: ClusterState, residencies: list[Residency],
                  due: Callable[[Any], bool]) -> None:
        """Adopt what the pool runs on its own; delete local instances it no longer runs.
        due(key): whether a command for key may be sent (again) now."""
        mine = {(i.model, i.generation): i for i in state.instances.values()
                if i.origin == "local" and i.ranks[0].node_id == self.node_id}
        running = {(r.model_id, r.generation): r for r in residencies if r.state != "stopped"}
        for key, residency in running.items():
            if key in mine or residency.hosted:
                continue  # mirrored already, or run for a placed instance
            facts = self._facts_for(residency.model_id)
            if facts is not None and due(("adopt", key)):
                self._send(AdoptInstance(command_id=new_command_id(),
                                         instance=self.local_instance(facts,
                                                                      residency.generation)))
        for key, instance in mine.items():
            if key not in running and due(("delete", instance.instance_id)):
                self._send(DeleteInstance(command_id=new_command_id(),
                                          instance_id=instance.instance_id,
                                          reason=f"node {self.node_id} unloaded the model"))

    def local_instance(self, facts: ModelFacts, generation: int) -> Instance:
        instance_id = local_instance_id(self.node_id, facts.model, generation)
        rank = Rank(runner_id=runner_id_for(instance_id, 0), node_id=self.node_id, rank=0,
                    world_size=1, layer_start=0, layer_end=facts.n_layers)
        return Instance(instance_id=instance_id, request=PlacementRequest(facts=facts),
                        sharding="single", ranks=(rank,), origin="local",
                        generation=generation)

    def _facts_for(self, model_id: str) -> ModelFacts | None:
        if model_id in self._facts:
            return self._facts[model_id]
        if model_id not in self._jobs:
            self._jobs[model_id] = asyncio.create_task(self._read(model_id))
        return None

    async def _read(self, model_id: str) -> None:
        try:
            source = self._source_of(model_id)
            self._facts[model_id] = await asyncio.to_thread(self._read_facts, source)
        except Exception as error:  # noqa: BLE001 - such a model is served but not listed
            log.warning("model %s cannot be listed in the cluster: %s", model_id, error)
            self._facts[model_id] = None
        finally:
            self._jobs.pop(model_id, None)
            self._wake()
