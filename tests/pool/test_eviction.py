"""choose_victims: which idle models go so another fits (pure)."""

from __future__ import annotations

from shoal.pool.eviction import Resident, choose_victims, eviction_order

MIB = 2**20


def resident(name: str, size_mib: int = 100, **fields) -> Resident:
    return Resident(instance_id=name, model=f"model-{name}", bytes=size_mib * MIB, **fields)


def ids(victims) -> list[str] | None:
    return None if victims is None else [v.instance_id for v in victims]


def test_nothing_is_evicted_when_the_model_fits():
    assert choose_victims([resident("a")], 50 * MIB, free_bytes=60 * MIB) == ()


def test_least_recently_used_goes_first_among_equal_priorities():
    residents = [resident("new", last_used=30), resident("old", last_used=10),
                 resident("mid", last_used=20)]
    assert ids(choose_victims(residents, 150 * MIB, free_bytes=0)) == ["old", "mid"]


def test_least_urgent_priority_goes_before_older_urgent_ones():
    residents = [resident("urgent", priority=0, last_used=1),
                 resident("batch", priority=9, last_used=50)]
    assert ids(choose_victims(residents, 50 * MIB, free_bytes=0)) == ["batch"]


def test_pinned_and_busy_models_are_never_chosen():
    residents = [resident("pinned", pinned=True), resident("busy", busy=True),
                 resident("idle", last_used=99)]
    assert ids(choose_victims(residents, 100 * MIB, free_bytes=0)) == ["idle"]
    assert [r.instance_id for r in eviction_order(residents)] == ["idle"]


def test_none_when_evicting_every_idle_model_is_not_enough():
    residents = [resident("pinned", pinned=True), resident("idle", 100)]
    assert choose_victims(residents, 150 * MIB, free_bytes=40 * MIB) is None


def test_only_as_many_as_needed_go():
    residents = [resident("a", 300, last_used=1), resident("b", 300, last_used=2)]
    assert ids(choose_victims(residents, 250 * MIB, free_bytes=0)) == ["a"]


def test_a_model_slot_is_freed_even_when_memory_suffices():
    residents = [resident("a", last_used=2), resident("b", last_used=1)]
    assert ids(choose_victims(residents, 10 * MIB, free_bytes=10**12, slots_needed=1)) == ["b"]
    assert choose_victims([resident("a", busy=True)], 1, 10**12, slots_needed=1) is None
