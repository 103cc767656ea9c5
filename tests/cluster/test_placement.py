"""Placement: memory model, single / pipeline / tensor, constraints, widening, previews."""

from __future__ import annotations

import random

import pytest
from state_builders import GIB, facts

from shoal.cluster.instances import PlacementRequest, Rendezvous
from shoal.cluster.placement import (
    NodeCapacity,
    Placement,
    PlacementError,
    PlacementPolicy,
    kv_heads_per_rank,
    load_refusal,
    place,
    place_exact,
    previews,
    shard_bytes,
    split_layers,
    tensor_share,
    usable_device,
    usable_ram,
    widen,
)

# Round numbers so expectations can be worked out by hand: weights x 1.25, KV for 1024
# tokens in bf16, no floor unless a test sets one.
RENDEZVOUS = Rendezvous(host="127.0.0.1", port=29500)
POLICY = PlacementPolicy(overhead_factor=1.25, kv_reservation_tokens=1024, kv_element_bytes=2,
                         floor_bytes=0, generation_floor_bytes=0)
MODEL = facts(weight_bytes=8 * GIB, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128)
# KV per token per layer: 2 (K and V) * 8 heads * 128 * 2 bytes = 4 KiB; x 1024 tokens = 4 MiB.
KV_PER_LAYER = 4 * 2**20


def nodes(**usable_gib: float) -> list[NodeCapacity]:
    return [NodeCapacity(node_id=name, usable_bytes=int(gib * GIB))
            for name, gib in usable_gib.items()]


def request(**fields) -> PlacementRequest:
    return PlacementRequest(facts=fields.pop("model", MODEL), **fields)


def test_shard_bytes_follows_the_memory_model():
    assert shard_bytes(MODEL, 32, 1, POLICY) == 10 * GIB + 32 * KV_PER_LAYER
    assert shard_bytes(MODEL, 8, 1, POLICY) == 10 * GIB // 4 + 8 * KV_PER_LAYER
    # Tensor rank of 4: a quarter of the weights and of the 8 KV heads.
    assert shard_bytes(MODEL, 32, 4, POLICY) == 10 * GIB // 4 + 32 * KV_PER_LAYER // 4
    floored = PlacementPolicy(overhead_factor=1.25, kv_reservation_tokens=1024, floor_bytes=GIB,
                              generation_floor_bytes=0)
    assert shard_bytes(MODEL, 32, 1, floored) == shard_bytes(MODEL, 32, 1, POLICY) + GIB


def test_an_int8_kv_cache_reserves_its_values_and_scales():
    int8 = PlacementPolicy.for_kv_cache_dtype("int8")
    assert (int8.kv_element_bytes, int8.kv_scale_bytes) == (1, 2)
    # Per token and layer: 2 * 8 heads * (128 + 8 scales of 2 bytes), against bf16's
    # 2 * 8 * 256.
    kv = (shard_bytes(MODEL, 32, 1, int8) - shard_bytes(MODEL, 32, 1, PlacementPolicy(
        kv_element_bytes=2)))
    assert kv == 32 * int8.kv_reservation_tokens * 2 * 8 * (144 - 256)
    assert MODEL.kv_bytes_per_token_per_layer(1, 1, 2) == 2 * 144
    odd = facts(weight_bytes=GIB, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=40)
    assert odd.kv_bytes_per_token_per_layer(1, 1, 2) == 2 * 42  # one scale per row
    assert PlacementPolicy.for_kv_cache_dtype("auto") == PlacementPolicy()
    assert PlacementPolicy.for_kv_cache_dtype("float32").kv_element_bytes == 4


def test_kv_heads_split_or_replicate():
    assert kv_heads_per_rank(8, 4) == 2
    assert kv_heads_per_rank(2, 4) == 1  # each KV head replicated on two ranks
    assert kv_heads_per_rank(3, 2) == 2  # uneven: the busier rank holds two groups
    with pytest.raises(ValueError):
        kv_heads_per_rank(3, 4)
    smollm2 = facts(n_heads=9, n_kv_heads=3, intermediate_size=1536)
    assert tensor_share(smollm2, 2) == pytest.approx(2 / 3)


def test_single_node_when_it_fits_prefers_most_memory():
    result = place(request(), nodes(a=12, b=16, c=11), POLICY)
    assert isinstance(result, Placement) and result.sharding == "single"
    (shard,) = result.shards
    assert (shard.node_id, shard.layer_start, shard.layer_end) == ("b", 0, 32)
    instance = result.to_instance("inst-1")
    assert instance.ranks[0].runner_id == "inst-1.r0" and instance.model == "tiny"


def test_auto_falls_back_to_the_narrowest_pipeline():
    result = place(request(), nodes(a=7, b=5, c=2), POLICY)
    assert isinstance(result, Placement) and result.sharding == "pipeline"
    assert [s.node_id for s in result.shards] == ["a", "b"]
    # Layers in proportion to memory: 7:5 of 32 layers is 18.67:13.33.
    assert [(s.layer_start, s.layer_end) for s in result.shards] == [(0, 19), (19, 32)]
    for shard in result.shards:
        assert shard.needed_bytes <= shard.usable_bytes
    instance = result.to_instance("i", RENDEZVOUS)
    assert instance.ranks[1].layers == (19, 32) and instance.rendezvous == RENDEZVOUS
    with pytest.raises(ValueError, match="rendezvous"):
        result.to_instance("i")  # several ranks must know where to meet


@pytest.mark.parametrize("seed", range(20))
def test_split_layers_sums_and_is_proportional(seed):
    rng = random.Random(seed)
    n_layers = rng.randint(2, 80)
    weights = [rng.randint(1, 100) * GIB for _ in range(rng.randint(1, min(8, n_layers)))]
    shares = split_layers(n_layers, weights)
    assert sum(shares) == n_layers and min(shares) >= 1
    total = sum(weights)
    for share, weight in zip(shares, weights, strict=True):
        # Largest remainder keeps each share within one layer of its ideal (or at 1).
        assert abs(share - n_layers * weight / total) < 1 or share == 1


def test_split_layers_gives_every_rank_a_layer_even_when_tiny():
    assert split_layers(4, [1000, 1, 1]) == (2, 1, 1)
    with pytest.raises(ValueError):
        split_layers(2, [1, 1, 1])


def test_explicit_pipeline_respects_min_nodes_even_when_one_node_would_do():
    result = place(request(sharding="pipeline", min_nodes=3), nodes(a=64, b=32, c=32), POLICY)
    assert isinstance(result, Placement) and result.width == 3
    assert [s.layer_end - s.layer_start for s in result.shards] == [16, 8, 8]


def test_explicit_split_that_fits_one_node_is_single():
    for sharding in ("pipeline", "tensor"):
        result = place(request(sharding=sharding), nodes(a=64, b=64), POLICY)
        assert isinstance(result, Placement)
        assert (result.sharding, result.width) == ("single", 1)


def test_auto_with_min_nodes_skips_single():
    result = place(request(min_nodes=2), nodes(a=64, b=64), POLICY)
    assert isinstance(result, Placement)
    assert (result.sharding, result.width) == ("pipeline", 2)


def test_tensor_splits_evenly():
    result = place(request(sharding="tensor", min_nodes=2), nodes(a=8, b=8, c=1), POLICY)
    assert isinstance(result, Placement) and result.sharding == "tensor"
    assert [(s.tp_rank, s.tp_size, s.layer_start, s.layer_end) for s in result.shards] == [
        (0, 2, 0, 32), (1, 2, 0, 32)]
    instance = result.to_instance("t", RENDEZVOUS)
    assert [r.tp_rank for r in instance.ranks] == [0, 1]


def test_tensor_needs_divisible_heads():
    model = facts(n_heads=14, n_kv_heads=2, intermediate_size=4864)
    result = place_exact(request(model=model, sharding="tensor"), nodes(a=64, b=64, c=64, d=64),
                         "tensor", 4, POLICY)
    assert isinstance(result, PlacementError) and "14 attention heads" in result.reason


def test_tensor_replicates_kv_heads_when_width_is_a_multiple():
    model = facts(n_heads=16, n_kv_heads=2, intermediate_size=4096)
    result = place_exact(request(model=model), nodes(a=64, b=64, c=64, d=64), "tensor", 4, POLICY)
    assert isinstance(result, Placement) and result.width == 4


def test_tensor_splits_kv_groups_unevenly_when_they_do_not_divide():
    model = facts(n_heads=12, n_kv_heads=4, intermediate_size=3072 + 1)
    result = place_exact(request(model=model), nodes(a=64, b=64, c=64), "tensor", 3, POLICY)
    assert isinstance(result, Placement) and result.width == 3


def test_a_mixture_of_experts_model_is_never_split_by_tensor():
    model = facts(n_heads=32, n_kv_heads=4, intermediate_size=None, n_experts=128)
    refused = place_exact(request(model=model), nodes(a=64, b=64), "tensor", 2, POLICY)
    assert isinstance(refused, PlacementError) and "mixture-of-experts" in refused.reason
    result = place(request(model=model, sharding="tensor", min_nodes=2), nodes(a=64, b=64),
                   POLICY)
    assert isinstance(result, PlacementError) and "mixture-of-experts" in result.reason
    auto = place(request(model=model, min_nodes=2), nodes(a=64, b=64), POLICY)
    assert isinstance(auto, Placement) and auto.sharding == "pipeline"


def test_tensor_refuses_kv_heads_that_neither_split_nor_replicate():
    model = facts(n_heads=9, n_kv_heads=3, intermediate_size=3072)
    result = place_exact(request(model=model), nodes(a=64, b=64, c=64, d=64), "tensor", 4,
                         POLICY)
    assert isinstance(result, PlacementError) and "KV groups" in result.reason


def test_excluded_nodes_are_never_used():
    result = place(request(excluded_nodes=("big",)), nodes(big=64, a=12, b=11), POLICY)
    assert isinstance(result, Placement)
    assert [s.node_id for s in result.shards] == ["a"]


def test_all_nodes_excluded_or_too_few_give_reasons():
    everyone = place(request(excluded_nodes=("a", "b")), nodes(a=64, b=64), POLICY)
    assert isinstance(everyone, PlacementError) and "excluded" in everyone.reason
    few = place(request(min_nodes=3, excluded_nodes=("c",)), nodes(a=64, b=64, c=64), POLICY)
    assert isinstance(few, PlacementError)
    assert "min_nodes is 3" in few.reason and "excluding c" in few.reason


def test_impossible_placement_explains_itself():
    result = place(request(), nodes(a=3, b=3), POLICY)
    assert isinstance(result, PlacementError) and not result.pending
    assert "single" in result.reason and "pipeline" in result.reason
    assert "GiB" in result.reason and "'tiny'" in result.reason


def test_no_memory_reports_yet_is_pending():
    result = place(request(), [], POLICY)
    assert isinstance(result, PlacementError) and result.pending


def test_widen_one_node_at_a_time_bounded_by_the_cluster():
    base = request()
    wider = widen(base, refused_width=1, cluster_size=3)
    assert wider is not None and wider.min_nodes == 2 and wider.facts == base.facts
    assert widen(base, refused_width=3, cluster_size=3) is None
    assert widen(request(sharding="single"), refused_width=1, cluster_size=3) is None
    # Keeps a larger min_nodes and the exclusions.
    kept = widen(request(min_nodes=3, excluded_nodes=("x",)), refused_width=1, cluster_size=5)
    assert kept.min_nodes == 3 and kept.excluded_nodes == ("x",)


def test_refuse_and_replace_loop_ends_within_cluster_size():
    cluster = nodes(a=64, b=64, c=64)
    current = request()
    widths = []
    while current is not None:
        result = place(current, cluster, POLICY)
        if isinstance(result, PlacementError):
            break
        widths.append(result.width)
        current = widen(current, result.width, len(cluster))  # every load "refuses"
    assert widths == [1, 2, 3]


def test_previews_list_every_option_with_fit_or_reason():
    options = previews(request(model=facts(n_kv_heads=2)), nodes(a=12, b=4, c=4), POLICY)
    table = {(p.sharding, p.width): p for p in options}
    assert set(table) == {("single", 1), ("pipeline", 2), ("pipeline", 3),
                          ("tensor", 2), ("tensor", 3)}
    assert table[("single", 1)].placement is not None
    assert table[("pipeline", 3)].placement is not None
    assert table[("tensor", 3)].error is not None and "heads" in table[("tensor", 3)].error
    assert table[("tensor", 2)].error is not None and "GiB" in table[("tensor", 2)].error


def test_usable_memory_leaves_the_system_and_the_driver_their_share():
    assert usable_ram(memory_total=100, memory_available=95) == 90
    assert usable_ram(memory_total=100, memory_available=50) == 50
    assert usable_device(80 * GIB, 79 * GIB) == int(80 * GIB * 0.95)
    assert usable_device(80 * GIB, 70 * GIB) == 70 * GIB


def test_load_refusal_uses_the_same_memory_model_with_a_tolerance():
    placed = place(request(), nodes(a=7, b=5), POLICY)
    instance = placed.to_instance("i", RENDEZVOUS)
    need_b = shard_bytes(MODEL, 13, 1, POLICY)
    assert load_refusal(instance, "b", need_b, POLICY) is None
    # Live memory a little below the need is jitter; far below is a refusal.
    assert load_refusal(instance, "b", int(need_b * 0.95), POLICY, tolerance=0.10) is None
    reason = load_refusal(instance, "b", need_b // 2, POLICY, tolerance=0.10)
    assert reason is not None and "rank 1" in reason and "'tiny'" in reason
    with pytest.raises(ValueError):
        load_refusal(instance, "zz", GIB, POLICY)


def test_a_node_s_capacity_is_its_budget_less_what_its_instances_hold():
    from shoal.cluster.node_budget import node_capacity
    from shoal.cluster.state import ClusterState, RunnerStatus
    from shoal.cluster.telemetry import NodeReading

    from shoal.ids import InstanceId, NodeId

    model = facts(weight_bytes=100 * 2**20, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                  intermediate_size=64)
    placed = place(request(model=model), nodes(a=8)).to_instance(InstanceId("i1"))
    state = ClusterState(instances={placed.instance_id: placed})
    reading = NodeReading(node_id=NodeId("a"), taken_at=0, memory_budget=4 * 2**30,
                          max_loaded_models=1)
    estimated = node_capacity(reading, state)
    assert estimated.usable_bytes == 4 * 2**30 - shard_bytes(model, 4)  # placement's estimate
    assert estimated.free_slots == 0 and not estimated.has_slot
    measured = state.model_copy(update={"runners": {placed.ranks[0].runner_id: RunnerStatus(
        runner_id=placed.ranks[0].runner_id, instance_id=placed.instance_id,
        node_id=NodeId("a"), phase="ready", memory_bytes=300 * 2**20)}})
    assert node_capacity(reading, measured).usable_bytes == 4 * 2**30 - 300 * 2**20
    # A node at --max-loaded-models takes no further model, whatever its memory.
    refused = place(request(model=model), [estimated])
    assert not isinstance(refused, Placement) and "max-loaded-models" in refused.reason
    # With no budget reported, placement uses live memory as before.
    assert node_capacity(NodeReading(node_id=NodeId("a"), taken_at=0, memory_total=2**30,
                                     memory_available=2**29), state).free_slots is None


# A mixture-of-experts model: 8 GiB of which 6 GiB are 8 routed experts per layer.
MOE = facts(n_heads=32, n_kv_heads=8, intermediate_size=None, n_experts=8,
            expert_bytes=6 * GIB)


def test_expert_ranks_hold_every_layer_and_experts_split_by_room():
    # Replicated: (2 GiB x 1.25) + 128 MiB KV; each expert 6/8 GiB x 1.25 = 0.9375 GiB.
    replicated = shard_bytes(MOE, 32, 1, POLICY, experts_held=0)
    assert replicated == int(2.5 * GIB) + 32 * KV_PER_LAYER
    assert shard_bytes(MOE, 32, 1, POLICY, experts_held=8) == shard_bytes(MOE, 32, 1, POLICY)
    result = place_exact(request(model=MOE), nodes(a=9, b=5), "expert", 2, POLICY)
    assert isinstance(result, Placement) and result.sharding == "expert"
    # Rooms ~6.4 and ~2.4 GiB: 6 and 2 experts (largest remainder).
    assert [(s.layer_start, s.layer_end) for s in result.shards] == [(0, 32), (0, 32)]
    assert [(s.expert_start, s.expert_end) for s in result.shards] == [(0, 6), (6, 8)]
    instance = result.to_instance("i", RENDEZVOUS)
    assert [r.experts for r in instance.ranks] == [(0, 6), (6, 8)]
    assert [r.tp_size for r in instance.ranks] == [1, 1]
    assert load_refusal(instance, "b", 5 * GIB, POLICY) is None
    assert load_refusal(instance, "a", 4 * GIB, POLICY) is not None


def test_auto_picks_experts_for_a_moe_model_too_big_for_one_node_else_a_pipeline():
    # 10.1 GiB whole: fits neither 7 GiB node; experts over two need ~6.3 and ~6.3 GiB.
    auto = place(request(model=MOE), nodes(a=7, b=7), POLICY)
    assert isinstance(auto, Placement) and auto.sharding == "expert" and auto.width == 2
    # Too little room beside the replicated part for experts over two: a pipeline of two.
    tight = place(request(model=MOE), nodes(a=5.5, b=5.5), POLICY)
    assert isinstance(tight, Placement) and tight.sharding == "pipeline"
    # Fits one node: single, whatever it is.
    assert place(request(model=MOE), nodes(a=16, b=7), POLICY).sharding == "single"
    # A dense model is never split by experts.
    assert place(request(), nodes(a=7, b=7), POLICY).sharding == "pipeline"


def test_expert_sharding_needs_experts_enough_for_its_width():
    dense = place(request(sharding="expert", min_nodes=2), nodes(a=64, b=64), POLICY)
    assert isinstance(dense, PlacementError)
    assert "expert sharding needs a mixture-of-experts model" in dense.reason
    narrow = facts(intermediate_size=None, n_experts=2, expert_bytes=GIB)
    wide = place_exact(request(model=narrow), nodes(a=9, b=9, c=9), "expert", 3, POLICY)
    assert isinstance(wide, PlacementError) and "exceed the model's 2 experts" in wide.reason
    options = {(p.sharding, p.width) for p in previews(request(model=MOE), nodes(a=9, b=9),
                                                       POLICY)}
    assert ("expert", 2) in options


def test_expert_instances_cover_every_expert_in_order():
    from shoal.cluster.instances import Instance, Rank

    def ranks(*ranges):
        return tuple(Rank(runner_id=f"r{i}", node_id=f"n{i}", rank=i, world_size=len(ranges),
                          layer_start=0, layer_end=32, expert_start=s, expert_end=e)
                     for i, (s, e) in enumerate(ranges))

    def make(sharding, *ranges):
        return Instance(instance_id="i", request=request(model=MOE), sharding=sharding,
                        ranks=ranks(*ranges), rendezvous=RENDEZVOUS)

    assert make("expert", (0, 3), (3, 8)).ranks[1].experts == (3, 8)
    for bad in [((0, 3), (4, 8)), ((0, 3), (3, 7)), ((0, 8), (8, 8))]:
        with pytest.raises(ValueError, match="expert"):
            make("expert", *bad)


# -- nodes holding the model's files ------------------------------------------------------


def holding(node: NodeCapacity, *models: str) -> NodeCapacity:
    return NodeCapacity(node.node_id, node.usable_bytes, node.free_slots,
                        holds=frozenset(m.lower() for m in models))


def test_a_single_instance_goes_to_a_node_holding_the_files_when_it_fits_there():
    big, small = nodes(big=40, small=20)
    placed = place(request(), [big, holding(small, MODEL.model)], POLICY)
    assert [s.node_id for s in placed.shards] == ["small"]
    # Too small to hold it: the files are fetched by the node where it fits.
    tiny = NodeCapacity("tiny", 2 * GIB, holds=frozenset({MODEL.model.lower()}))
    placed = place(request(), [big, tiny], POLICY)
    assert [s.node_id for s in placed.shards] == ["big"]


def test_the_preferred_node_comes_before_a_holder():
    a, b = nodes(a=20, b=20)
    placed = place(request(preferred_node="a"), [a, holding(b, MODEL.model)], POLICY)
    assert [s.node_id for s in placed.shards] == ["a"]


def test_a_pipeline_takes_the_holders_first_where_they_fit():
    a, b, c = nodes(a=30, b=30, c=8)
    placed = place_exact(request(), [a, b, holding(c, MODEL.model)], "pipeline", 2, POLICY)
    assert [s.node_id for s in placed.shards] == ["c", "a"]
    # The holder cannot take even its proportional share: the two largest, as before.
    d = NodeCapacity("d", GIB // 8, holds=frozenset({MODEL.model.lower()}))
    placed = place_exact(request(), [a, b, d], "pipeline", 2, POLICY)
    assert [s.node_id for s in placed.shards] == ["a", "b"]


def test_a_kv_grant_fits_the_budget_beside_what_every_instance_holds_now():
    from shoal.cluster.node_budget import has_room_for
    from shoal.cluster.state import ClusterState

    from shoal.ids import InstanceId, NodeId

    model = facts(weight_bytes=100 * 2**20, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                  intermediate_size=64)
    placed = place(request(model=model), nodes(a=8)).to_instance(InstanceId("i1"))
    state = ClusterState(instances={placed.instance_id: placed})
    estimate = shard_bytes(model, 4)
    assert has_room_for(state, NodeId("a"), estimate + 10, 10, {})
    assert not has_room_for(state, NodeId("a"), estimate + 10, 11, {})
    # The runner's live figure (every grant counted) replaces the state's.
    assert has_room_for(state, NodeId("a"), 2**30, 2**30 - 5, {"i1": 5})
    assert not has_room_for(state, NodeId("a"), 2**30, 2**30 - 5, {"i1": 6})


def test_a_measured_size_replaces_the_estimate_for_a_whole_copy_only():
    model = facts(weight_bytes=100 * 2**20, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                  intermediate_size=64)
    measured = model.model_copy(update={"measured_bytes": 42 * 2**20})
    assert shard_bytes(measured, 4) == 42 * 2**20
    assert shard_bytes(measured, 2) == shard_bytes(model, 2)  # a pipeline rank: estimated


def test_an_estimate_at_most_15_percent_over_the_room_is_tried_a_measurement_is_not():
    from shoal.cluster.placement import bytes_to_find

    model = facts(weight_bytes=100 * 2**20, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                  intermediate_size=64)
    estimate = shard_bytes(model, 4)
    room = int(estimate / 1.14)
    assert isinstance(place(request(model=model), nodes(a=room / GIB)), Placement)
    assert not isinstance(place(request(model=model), nodes(a=estimate / 1.16 / GIB)),
                          Placement)
    measured = model.model_copy(update={"measured_bytes": estimate})
    assert bytes_to_find(measured, estimate, whole=True) == estimate
    assert not isinstance(place(request(model=measured), nodes(a=room / GIB)), Placement)
