"""Capability cards: last-writer-wins merge per node, expiry on read and on merge, this
node's own card authoritative, push-pull exchange converging over an in-memory hub, and
a silent node's card ageing out; the proposer choice is deterministic and prefers idle,
remote capacity."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from shoal.cluster.card_exchange import CardConfig, CardExchange
from shoal.cluster.cards import (
    CapabilityCard,
    CardLoad,
    CardRegistry,
    ModelRole,
    cards_from_wire,
    cards_to_wire,
    choose_proposer,
)
from shoal.cluster.transport import MemoryHub

PROPOSER = ModelRole(model="smollm2-135m-instruct", role="proposer", source="ngram")


def card(node: str, at: float, ttl: float = 10.0, busy: int = 0, cpu: float = 0.0,
         models: tuple[ModelRole, ...] = ()) -> CapabilityCard:
    return CapabilityCard(node_id=node, announced_at=at, ttl_s=ttl, models=models,
                          load=CardLoad(in_flight=busy, cpu_percent=cpu))


def test_newest_card_wins_whatever_the_order_and_repeats():
    cards = [card("b", 5.0), card("b", 7.0), card("c", 6.0), card("b", 6.0), card("c", 6.0)]
    views = []
    for order in itertools.permutations(cards):
        registry = CardRegistry(card("a", 0.0, ttl=100))
        registry.merge(order[:2], now=7.0)
        registry.merge(order[2:], now=7.0)
        registry.merge(order, now=7.0)  # idempotent
        views.append({n: c.announced_at for n, c in registry.snapshot(now=7.0).items()})
    assert all(view == {"a": 0.0, "b": 7.0, "c": 6.0} for view in views)


def test_own_card_is_authoritative_and_never_expires_locally():
    registry = CardRegistry(card("a", 1.0, ttl=5))
    changed = registry.merge([card("a", 99.0, models=(PROPOSER,))], now=2.0)
    assert changed == [] and registry.own.announced_at == 1.0
    assert registry.snapshot(now=1000.0)["a"].announced_at == 1.0
    registry.set_own(card("a", 3.0))
    assert registry.snapshot(now=3.0)["a"].announced_at == 3.0
    with pytest.raises(ValueError):
        registry.set_own(card("b", 3.0))


def test_expired_cards_are_dropped_on_read_and_refused_on_merge():
    registry = CardRegistry(card("a", 0.0))
    assert registry.merge([card("b", 10.0, ttl=5), card("c", 1.0, ttl=5)], now=12.0) == ["b"]
    assert set(registry.snapshot(now=14.9)) == {"a", "b"}
    assert set(registry.snapshot(now=15.1)) == {"a"}
    # A stale copy of b arriving later does not bring it back.
    assert registry.merge([card("b", 10.0, ttl=5)], now=16.0) == []
    assert set(registry.snapshot(now=16.0)) == {"a"}


def test_wire_round_trip_skips_malformed_cards():
    good = card("b", 1.0, models=(PROPOSER,))
    raw = cards_to_wire([good]) + [{"node_id": "c"}, "junk", {**cards_to_wire([good])[0],
                                                              "ttl_s": -1}]
    assert cards_from_wire(raw) == [good]
    assert cards_from_wire("not a list") == []


def test_choice_prefers_another_node_then_idle_then_id_and_is_deterministic():
    verifier = card("v", 0.0, models=(PROPOSER,))
    busy = card("p1", 0.0, busy=3, models=(PROPOSER,))
    idle_hot = card("p2", 0.0, cpu=95.0, models=(PROPOSER,))
    idle_cool = card("p3", 0.0, cpu=12.0, models=(PROPOSER,))
    twin = card("p0", 0.0, cpu=14.0, models=(PROPOSER,))
    other = card("x", 0.0, models=(ModelRole(model="gemma-3-270m", role="proposer"),))
    cards = [verifier, busy, idle_hot, idle_cool, twin, other]
    target = "SmolLM2-135M-Instruct"  # model names match without regard to case
    assert choose_proposer(cards, target, "v") == "p0"  # p0 and p3 tie on load: smaller id
    assert all(choose_proposer(list(order), target, "v") == "p0"
               for order in itertools.permutations(cards[:5]))
    assert choose_proposer(cards, target, "v", avoid=frozenset({"p0", "p3"})) == "p2"
    assert choose_proposer([verifier, other], target, "v") == "v"  # alone: itself
    assert choose_proposer([other], target, "v") is None


def test_push_pull_exchange_converges_and_a_silent_nodes_card_expires():
    async def main():
        hub = MemoryHub()
        config = CardConfig(interval_s=0.05, ttl_s=0.6)
        exchanges = {}
        for name in ("n1", "n2", "n3"):
            transport = hub.connect(name)

            def build(at, ttl, name=name):
                return card(name, at, ttl, models=(PROPOSER,) if name == "n3" else ())
            exchanges[name] = CardExchange(transport, config, build)
        await exchanges["n1"].start()
        await exchanges["n2"].start()
        await asyncio.sleep(0.02)
        # n3 joins later: one push-pull round on joining gives it every card.
        await exchanges["n3"].start()
        await asyncio.sleep(0.03)
        joined = {name: [c.node_id for c in x.cards()] for name, x in exchanges.items()}
        # n3 vanishes; the others stop hearing from it and its card ages out.
        await exchanges["n3"].stop()
        hub.drop("n3")
        await asyncio.sleep(0.1)
        before_ttl = [c.node_id for c in exchanges["n1"].cards()]
        await asyncio.sleep(0.7)
        after_ttl = {name: [c.node_id for c in exchanges[name].cards()]
                     for name in ("n1", "n2")}
        for name in ("n1", "n2"):
            await exchanges[name].stop()
        return joined, before_ttl, after_ttl

    joined, before_ttl, after_ttl = asyncio.run(main())
    assert joined == {name: ["n1", "n2", "n3"] for name in ("n1", "n2", "n3")}
    assert before_ttl == ["n1", "n2", "n3"]
    assert after_ttl == {"n1": ["n1", "n2"], "n2": ["n1", "n2"]}


def test_propose_for_names_the_target_by_its_catalogue_id_and_checks_the_source():
    from shoal.cluster.proposer_service import ProposerConfig
    from shoal.config import build_cluster_settings

    settings = build_cluster_settings(propose_for=["smollm2", "my-model=ngram"], env={})
    assert settings.propose_for == (("smollm2-135m-instruct", "ngram"), ("my-model", "ngram"))
    from_env = build_cluster_settings(env={"SHOAL_PROPOSE_FOR": "smollm2",
                                           "SHOAL_CARD_INTERVAL": "1", "SHOAL_CARD_TTL": "3"})
    assert from_env.propose_for == (("smollm2-135m-instruct", "ngram"),)
    assert (from_env.card_interval_s, from_env.card_ttl_s) == (1.0, 3.0)
    with pytest.raises(ValueError, match="twice"):
        build_cluster_settings(propose_for=["smollm2", "SmolLM2-135M-Instruct"], env={})
    with pytest.raises(ValueError, match="name the target"):
        build_cluster_settings(propose_for=["=ngram"], env={})
    with pytest.raises(ValueError, match="two exchange intervals"):
        build_cluster_settings(env={"SHOAL_CARD_INTERVAL": "5", "SHOAL_CARD_TTL": "6"})
    with pytest.raises(ValueError, match="must be one of draft, ngram"):
        ProposerConfig(offers={"smollm2-135m-instruct": "crystal-ball"})
