"""The router's choice among live instances of a model: ready first, then the instance a
request's session went to last, then the one holding the longest prefix of its prompt,
then this node's, then the least busy."""

from __future__ import annotations

from types import SimpleNamespace

from shoal.cluster.instances import Instance, PlacementRequest, Rank, Rendezvous
from shoal.cluster.model_facts import ModelFacts
from shoal.cluster.prefix_index import PrefixIndex, PrefixUpdate
from shoal.engine.kv.prefix_cache import extend_block_hashes
from shoal.ids import InstanceId, ModelId, NodeId, runner_id_for
from shoal.router.chooser import InstanceChooser
from shoal.protocol import ChatMessage, GenerationRequest
from shoal.routing_keys import prefix_keys, session_key

DOCUMENT = "A long shared system prompt about rivers. " * 100
BLOCK = extend_block_hashes([], list(range(16)), 16)[0]


def single(instance_id: str, on: str) -> Instance:
    return pipeline(instance_id, on)


def pipeline(instance_id: str, *nodes: str) -> Instance:
    """An instance of the two-layer model over the given nodes, one layer range per rank."""
    facts = ModelFacts(model=ModelId("tiny"), weight_bytes=1, n_layers=2, n_heads=2,
                       n_kv_heads=1, head_dim=8)
    bounds = [0, 1, 2] if len(nodes) == 2 else [0, 2]
    ranks = tuple(Rank(runner_id=runner_id_for(InstanceId(instance_id), rank),
                       node_id=NodeId(node), rank=rank, world_size=len(nodes),
                       layer_start=bounds[rank], layer_end=bounds[rank + 1])
                  for rank, node in enumerate(nodes))
    split = len(nodes) > 1
    return Instance(instance_id=InstanceId(instance_id), request=PlacementRequest(facts=facts),
                    sharding="pipeline" if split else "single", ranks=ranks,
                    rendezvous=Rendezvous(host="127.0.0.1", port=29500) if split else None)


class FakeState:
    def __init__(self, instances, statuses=None, tasks=None):
        self.instances = {i.instance_id: i for i in instances}
        self.statuses = statuses or {}
        self.tasks = tasks or {}

    def instances_of(self, model_id):
        return [i for i in self.instances.values() if i.model == model_id]

    def instance_status(self, instance_id):
        return self.statuses.get(instance_id, "ready")

    def tasks_of(self, instance_id):
        return [None] * self.tasks.get(instance_id, 0)


def chooser(instances, **state) -> tuple[InstanceChooser, PrefixIndex]:
    index = PrefixIndex()
    cluster = SimpleNamespace(node_id=NodeId("here"), peers=frozenset({NodeId("there")}),
                              state=FakeState(instances, **state),
                              prefixes=SimpleNamespace(index=index))
    pool = SimpleNamespace(registry={}, is_retiring=lambda _instance_id: False)
    return InstanceChooser(pool, cluster), index


def request(text: str = DOCUMENT, session: str | None = None) -> GenerationRequest:
    return GenerationRequest(request_id="r", model="tiny", session_id=session,
                             messages=(ChatMessage(role="system", content=text),
                                       ChatMessage(role="user", content="Which is longest?")))


def holds_prefix(index: PrefixIndex, instance_id: str, node: str, of: GenerationRequest):
    keys = prefix_keys(of)
    index.apply(PrefixUpdate(instance_id=instance_id, node_id=NodeId(node), compat="c", seq=1,
                             stored=(BLOCK,), anchors=tuple((k, BLOCK) for k in keys)))


def test_without_affinity_this_node_s_instance_serves():
    local, remote = single("local", "here"), single("remote", "there")
    choose, _ = chooser([local, remote])
    assert choose.choose("tiny", False, request()) is local


def test_the_instance_holding_the_prompt_s_prefix_wins_over_this_node():
    local, remote = single("local", "here"), single("remote", "there")
    choose, index = chooser([local, remote])
    holds_prefix(index, "remote", "there", request())
    later_turn = request(DOCUMENT)  # same system prompt, another question
    assert choose.choose("tiny", False, later_turn) is remote
    other = request("Something else entirely. " * 100)
    assert choose.choose("tiny", False, other) is local
    # Once the holder lost the block, its keys lead nowhere.
    index.apply(PrefixUpdate(instance_id="remote", node_id=NodeId("there"), compat="c",
                             seq=2, removed=(BLOCK,)))
    assert choose.choose("tiny", False, later_turn) is local


def test_a_session_sticks_to_the_instance_that_served_it_last():
    local, remote = single("local", "here"), single("remote", "there")
    choose, index = chooser([local, remote])
    holds_prefix(index, "local", "here", request())
    pinned = request(session="chat-1")
    index.pin(session_key("chat-1"), "remote")
    assert choose.choose("tiny", False, pinned) is remote  # beats the prefix held here
    choose.pin_session(request(session="chat-1"), local)
    assert choose.choose("tiny", False, pinned) is local


def test_a_pinned_instance_that_is_gone_or_loading_does_not_hold_the_session():
    local, remote = single("local", "here"), single("remote", "there")
    choose, index = chooser([local, remote], statuses={"remote": "loading"})
    index.pin(session_key("chat-1"), "remote")
    assert choose.choose("tiny", False, request(session="chat-1")) is local
    choose, index = chooser([local])
    index.pin(session_key("chat-1"), "remote")
    assert choose.choose("tiny", False, request(session="chat-1")) is local


def test_among_equals_the_least_busy_serves():
    first, second = single("first", "there"), single("second", "there")
    choose, _ = chooser([first, second], tasks={"first": 3})
    assert choose.choose("tiny", False, request()) is second


def test_an_instance_with_a_rank_on_a_vanished_node_is_not_live():
    """A retry must not go to a pipeline whose serving rank is here or present but whose
    other rank's node is gone: it would fail a second time."""
    broken, whole = pipeline("broken", "here", "gone"), pipeline("whole", "there", "here")
    choose, _ = chooser([broken, whole])
    assert choose.live("tiny") == [whole]
    assert choose.choose("tiny", False, request()) is whole
