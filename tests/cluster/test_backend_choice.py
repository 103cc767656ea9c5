"""Which backend serves a model, and placement going only where that backend runs."""

from __future__ import annotations

import pytest
from state_builders import GIB, facts

from shoal.cluster.backends import BackendChoiceError, choose_backend
from shoal.cluster.instances import PlacementRequest
from shoal.cluster.placement import NodeCapacity, Placement, PlacementError, place, previews
from shoal.cluster.telemetry import NodeReading

LLAMA = facts(weight_bytes=GIB, n_layers=16, n_heads=8, n_kv_heads=8, head_dim=64)
KNOWN = LLAMA.model_copy(update={"architecture": "llama"})
UNKNOWN = LLAMA.model_copy(update={"architecture": "rwkv7"})
EVERYWHERE = ("engine", "llama-server")


def test_shoals_engine_is_the_default_where_it_runs_the_architecture():
    assert choose_backend(KNOWN, "gguf", None, EVERYWHERE) == "engine"


def test_an_architecture_the_engine_lacks_goes_to_llama_server_where_one_runs():
    assert choose_backend(UNKNOWN, "gguf", None, EVERYWHERE) == "llama-server"
    with pytest.raises(BackendChoiceError, match="shoal's engine does not support it, and no "
                                                 "node runs llama-server"):
        choose_backend(UNKNOWN, "gguf", None, ("engine",))
    with pytest.raises(BackendChoiceError, match="GGUF files only"):
        choose_backend(UNKNOWN, "safetensors", None, EVERYWHERE)


def test_an_assigned_backend_wins_unless_it_cannot_run_the_model():
    assert choose_backend(KNOWN, "gguf", "llama-server", ("engine",)) == "llama-server"
    with pytest.raises(BackendChoiceError, match="does not support that architecture"):
        choose_backend(UNKNOWN, "gguf", "engine", EVERYWHERE)
    with pytest.raises(BackendChoiceError, match="GGUF files only"):
        choose_backend(KNOWN, "safetensors", "llama-server", EVERYWHERE)
    with pytest.raises(BackendChoiceError, match="image pipelines"):
        choose_backend(KNOWN, "gguf", "diffusers", EVERYWHERE)


def test_placement_goes_only_where_the_backend_runs():
    roomy = NodeCapacity("roomy", 64 * GIB)  # shoal's engine only
    small = NodeCapacity("small", 8 * GIB, backends=frozenset(EVERYWHERE))
    served = PlacementRequest(facts=KNOWN, backend="llama-server")
    placed = place(served, [roomy, small])
    assert isinstance(placed, Placement) and placed.shards[0].node_id == "small"
    assert place(PlacementRequest(facts=KNOWN), [roomy, small]).shards[0].node_id == "roomy"
    refused = place(served, [roomy])
    assert isinstance(refused, PlacementError) and "no node runs llama-server" in refused.reason
    assert [(p.sharding, p.width) for p in previews(served, [small, small])] == [("single", 1)]


def test_a_served_backend_is_never_split():
    with pytest.raises(ValueError, match="whole on one node"):
        PlacementRequest(facts=KNOWN, backend="llama-server", sharding="pipeline")


def test_telemetry_advertises_backends_and_placement_reads_them():
    reading = NodeReading(node_id="n1", taken_at=0.0, memory_total=16 * GIB,
                          memory_available=16 * GIB, backends=EVERYWHERE,
                          backend_devices={"engine": ("cpu",), "llama-server": ("cpu",)})
    assert reading.capacity().backends == frozenset(EVERYWHERE)
    # A node that advertises nothing still runs shoal's engine.
    bare = reading.model_copy(update={"backends": ()})
    assert bare.capacity().backends == frozenset({"engine"})


def test_a_node_with_a_budget_keeps_its_backends_for_placement():
    from shoal.cluster.node_budget import node_capacity
    from shoal.cluster.state import ClusterState

    reading = NodeReading(node_id="n1", taken_at=0.0, memory_total=16 * GIB,
                          memory_available=16 * GIB, backends=EVERYWHERE,
                          memory_budget=4 * GIB)
    assert node_capacity(reading, ClusterState()).backends == frozenset(EVERYWHERE)
