"""The prefix index: what each instance published (snapshots replace, deltas add), bounded
tables, the longest held run among compatible instances, routing keys leading to held
blocks, and sessions going to the instance that served them last."""

from __future__ import annotations

import pytest

from shoal.cluster.prefix_index import IndexLimits, PrefixIndex, PrefixUpdate
from shoal.engine.kv.prefix_cache import extend_block_hashes
from shoal.ids import NodeId

CHAIN = extend_block_hashes([], list(range(160)), 16)  # ten chained block hashes


def update(instance: str, seq: int = 1, compat: str = "c", node: str = "a",
           **fields) -> PrefixUpdate:
    return PrefixUpdate(instance_id=instance, node_id=NodeId(node), compat=compat, seq=seq,
                        **fields)


def test_the_longest_compatible_run_wins_and_the_asker_is_left_out():
    index = PrefixIndex()
    index.apply(update("i1", stored=tuple(CHAIN[:4])))
    index.apply(update("i2", node="b", stored=tuple(CHAIN[:7])))
    index.apply(update("i3", compat="other-weights", stored=tuple(CHAIN)))
    index.apply(update("i4", stored=tuple(CHAIN[1:])))  # lost its first block: no run
    instance, entry, held = index.best_holder(CHAIN, "c")
    assert (instance, entry.node_id, held) == ("i2", "b", 7)
    assert index.best_holder(CHAIN, "c", exclude="i2")[0] == "i1"
    assert index.best_holder(CHAIN, "nobody") is None


def test_deltas_add_and_remove_and_a_snapshot_replaces():
    index = PrefixIndex()
    index.apply(update("i1", stored=tuple(CHAIN[:5])))
    index.apply(update("i1", seq=2, removed=(CHAIN[3],)))
    assert index.best_holder(CHAIN, "c")[2] == 3
    index.apply(update("i1", seq=3, snapshot=True, stored=tuple(CHAIN[:2])))
    assert index.best_holder(CHAIN, "c")[2] == 2
    index.retain(["other"])
    assert "i1" not in index and index.best_holder(CHAIN, "c") is None


def test_tables_are_bounded_oldest_first():
    index = PrefixIndex(IndexLimits(max_blocks=3, max_anchors=2, max_sessions=2))
    index.apply(update("i1", stored=tuple(CHAIN[:5]),
                       anchors=tuple((bytes([k]), CHAIN[4]) for k in range(5)),
                       sessions=(b"s1", b"s2", b"s3")))
    entry = index.get("i1")
    assert list(entry.blocks) == CHAIN[2:5] and list(entry.anchors) == [bytes([3]), bytes([4])]
    assert index.session_instance(b"s1") is None and index.session_instance(b"s3") == "i1"


def test_routing_keys_count_only_while_their_block_is_held():
    index = PrefixIndex()
    keys = [b"k0", b"k1", b"k2"]
    index.apply(update("i1", stored=(CHAIN[2],), anchors=((b"k0", CHAIN[0]),
                                                         (b"k1", CHAIN[2]))))
    assert index.matched_keys("i1", keys) == 2
    assert index.matched_keys("i1", [b"k0"]) == 0  # its block is not held
    index.apply(update("i1", seq=2, removed=(CHAIN[2],)))
    assert index.matched_keys("i1", keys) == 0
    assert index.matched_keys("unknown", keys) == 0


def test_a_session_goes_where_it_was_seen_last_and_snapshots_do_not_undo_that():
    index = PrefixIndex()
    index.apply(update("i1", sessions=(b"s",)))
    index.apply(update("i2", sessions=(b"s",)))
    assert index.session_instance(b"s") == "i2"
    index.apply(update("i1", seq=2, snapshot=True, sessions=(b"s",)))  # an old sighting
    assert index.session_instance(b"s") == "i2"
    index.pin(b"s", "i1")  # the router just sent it there
    assert index.session_instance(b"s") == "i1"


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_blocks"):
        IndexLimits(max_blocks=0)
