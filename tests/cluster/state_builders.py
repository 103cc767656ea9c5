"""Small builders for cluster-state tests: facts, instances, tasks, indexed event streams."""

from __future__ import annotations

from collections.abc import Iterable

from shoal.cluster.events import Event, IndexedEvent
from shoal.cluster.instances import Instance, PlacementRequest, Rank, Rendezvous
from shoal.cluster.model_facts import ModelFacts
from shoal.cluster.state import NodeInfo, RunnerStatus, Task
from shoal.ids import InstanceId, ModelId, NodeId, RequestId, runner_id_for
from shoal.protocol import GenerationRequest

GIB = 2**30


def facts(model: str = "tiny", weight_bytes: int = 8 * GIB, n_layers: int = 32,
          n_heads: int = 32, n_kv_heads: int = 8, head_dim: int = 128,
          intermediate_size: int | None = 14336, n_experts: int = 0,
          expert_bytes: int = 0) -> ModelFacts:
    return ModelFacts(model=ModelId(model), weight_bytes=weight_bytes, n_layers=n_layers,
                      n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                      intermediate_size=intermediate_size, n_experts=n_experts,
                      expert_bytes=expert_bytes)


def node(name: str) -> NodeInfo:
    return NodeInfo(node_id=NodeId(name), name=name, addresses=(f"{name}.local:8470",))


def single(instance_id: str, on: str, model_facts: ModelFacts | None = None) -> Instance:
    model_facts = model_facts or facts()
    iid = InstanceId(instance_id)
    rank = Rank(runner_id=runner_id_for(iid, 0), node_id=NodeId(on), rank=0, world_size=1,
                layer_start=0, layer_end=model_facts.n_layers)
    return Instance(instance_id=iid, request=PlacementRequest(facts=model_facts),
                    sharding="single", ranks=(rank,))


def pipeline(instance_id: str, layout: Iterable[tuple[str, int]],
             model_facts: ModelFacts | None = None) -> Instance:
    """layout: (node, layer_end) per rank, in rank order."""
    layout = list(layout)
    model_facts = model_facts or facts(n_layers=layout[-1][1])
    iid = InstanceId(instance_id)
    ranks, start = [], 0
    for index, (on, end) in enumerate(layout):
        ranks.append(Rank(runner_id=runner_id_for(iid, index), node_id=NodeId(on), rank=index,
                          world_size=len(layout), layer_start=start, layer_end=end))
        start = end
    return Instance(instance_id=iid, request=PlacementRequest(facts=model_facts),
                    sharding="pipeline", ranks=tuple(ranks),
                    rendezvous=Rendezvous(host="127.0.0.1", port=29500))


def runner_status(instance: Instance, rank: int, phase: str, message: str = "") -> RunnerStatus:
    r = instance.ranks[rank]
    return RunnerStatus(runner_id=r.runner_id, instance_id=instance.instance_id,
                        node_id=r.node_id, phase=phase, message=message)


def task(task_id: str, instance: Instance, owner: str = "a") -> Task:
    request = GenerationRequest(request_id=task_id, model=instance.model, prompt="hello")
    return Task(task_id=RequestId(task_id), instance_id=instance.instance_id,
                owner_node=NodeId(owner), request=request)


def indexed(events: Iterable[Event], start: int = 0) -> list[IndexedEvent]:
    return [IndexedEvent(idx=start + i, event=e) for i, e in enumerate(events)]
