"""Which live instance of a model serves a request (pure reads of the cluster state).

Live means not failed, not retiring, and served from a node that is present. Among them:
ready ones first, then those served from this node, then the least busy.
"""

from __future__ import annotations

from shoal.cluster.instances import Instance
from shoal.cluster.service import ClusterService
from shoal.pool.pool import ModelPool


class InstanceChooser:
    def __init__(self, pool: ModelPool, cluster: ClusterService) -> None:
        self.pool = pool
        self.cluster = cluster

    def here(self, instance: Instance) -> bool:
        """The instance's serving rank (rank 0) runs on this node."""
        return instance.ranks[0].node_id == self.cluster.node_id

    def ready(self, model_id: str) -> Instance | None:
        """A live instance that serves now (a runner here that has loaded counts before the
        state hears of it)."""
        state = self.cluster.state
        for instance in self.live(model_id):
            if state.instance_status(instance.instance_id) == "ready":
                return instance
            runner = self.pool.registry.get((instance.instance_id, 0))
            if runner is not None and runner.state == "ready":
                return instance
        return None

    def choose(self, model_id: str, here_only: bool) -> Instance | None:
        """The best live instance; here_only: only one served whole on this node."""
        state = self.cluster.state
        candidates = []
        for instance in self.live(model_id):
            here = self.here(instance)
            if here_only and not (here and len(instance.ranks) == 1):
                continue
            status = state.instance_status(instance.instance_id)
            candidates.append((status != "ready", not here,
                               len(state.tasks_of(instance.instance_id)),
                               instance.instance_id, instance))
        return min(candidates, key=lambda c: c[:4])[4] if candidates else None

    def live(self, model_id: str) -> list[Instance]:
        """Instances of the model that may take a request."""
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

    def model_named(self, name: str) -> str | None:
        """The model id of an instance anywhere in the cluster whose model is `name`."""
        wanted = name.lower()
        for instance in self.cluster.state.instances.values():
            if instance.model.lower() == wanted:
                return instance.model
        return None
