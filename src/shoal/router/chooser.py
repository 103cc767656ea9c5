"""Which live instance of a model serves a request (pure reads of the cluster state).

Live means not failed, not retiring, and with every rank on a node that is present. Among
them: ready ones first; for a generation request, then the one its x_session_id went to
last, then the one holding the longest prefix of its prompt (cluster/prefix_index.py); then
those served from this node, then the least busy.
"""

from __future__ import annotations

from shoal.cluster.instances import Instance
from shoal.cluster.service import ClusterService
from shoal.pool.pool import ModelPool
from shoal.protocol import GenerationRequest
from shoal.routing_keys import prefix_keys, session_key


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

    def choose(self, model_id: str, here_only: bool,
               request: GenerationRequest | None = None,
               avoid: str | None = None) -> Instance | None:
        """The best live instance; here_only: only one served whole on this node;
        request: the generation request it is for (its session and prefix count);
        avoid: an instance taken only when no other is live (one that just failed)."""
        state = self.cluster.state
        live = [i for i in self.live(model_id)
                if not here_only or (self.here(i) and len(i.ranks) == 1)]
        if not live:
            return None
        pinned, matched = self._affinity(request, live)
        candidates = []
        for instance in live:
            status = state.instance_status(instance.instance_id)
            candidates.append((instance.instance_id == avoid, status != "ready",
                               instance.instance_id != pinned,
                               -matched.get(instance.instance_id, 0), not self.here(instance),
                               len(state.tasks_of(instance.instance_id)),
                               instance.instance_id, instance))
        return min(candidates, key=lambda c: c[:7])[7]

    def _affinity(self, request: GenerationRequest | None, live: list[Instance]
                  ) -> tuple[str | None, dict[str, int]]:
        """(the instance the request's session went to last, routing keys of its prompt
        matched per instance); nothing to go by for one candidate or no request."""
        index = getattr(self.cluster, "prefixes", None)
        if request is None or index is None or len(live) < 2:
            return None, {}
        index = index.index
        pinned = None
        if request.session_id is not None:
            pinned = index.session_instance(session_key(request.session_id))
        keys = prefix_keys(request)
        return pinned, {i.instance_id: index.matched_keys(i.instance_id, keys) for i in live}

    def pin_session(self, request: GenerationRequest, instance: Instance) -> None:
        """The request's session (if it has one) goes to instance from now on."""
        index = getattr(self.cluster, "prefixes", None)
        if request.session_id is not None and index is not None:
            index.index.pin(session_key(request.session_id), instance.instance_id)

    def live(self, model_id: str) -> list[Instance]:
        """Instances of the model that may take a request."""
        state, peers = self.cluster.state, self.cluster.peers
        out = []
        for instance in state.instances_of(model_id):
            # Every rank's node, not only the serving one's: a pipeline whose other rank's
            # node vanished cannot answer (a retry sent there would fail a second time).
            if any(rank.node_id != self.cluster.node_id and rank.node_id not in peers
                   for rank in instance.ranks):
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
