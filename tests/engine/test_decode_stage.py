"""The decode stage's bookkeeping: when a batch appends, is rebuilt, or is gathered."""

from __future__ import annotations

from shoal.engine.kv.stage import ROW_GRANULE, DecodeStage


def test_a_steady_batch_is_built_once_then_appends():
    stage = DecodeStage(first_slot=1000, capacity=4 * ROW_GRANULE)
    first = stage.place(("a", "b"), (10, 20))
    assert first.rebuild and first.first == 1000 and first.row_len == ROW_GRANULE
    for grown in range(1, 5):
        placement = stage.place(("a", "b"), (10 + grown, 20 + grown))
        assert not placement.rebuild and placement.row_len == ROW_GRANULE


def test_any_change_of_the_batch_rebuilds():
    stage = DecodeStage(first_slot=0, capacity=8 * ROW_GRANULE)
    stage.place(("a", "b"), (10, 20))
    assert stage.place(("a", "b", "c"), (11, 21, 5)).rebuild  # a request joined
    assert stage.place(("a", "c"), (12, 6)).rebuild  # one left
    assert stage.place(("c", "a"), (7, 13)).rebuild  # same requests, other order
    assert stage.place(("c", "a"), (9, 14)).rebuild  # a row did not grow by exactly one


def test_a_full_row_is_rebuilt_longer():
    stage = DecodeStage(first_slot=0, capacity=8 * ROW_GRANULE)
    assert stage.place(("a",), (ROW_GRANULE - 1,)).row_len == ROW_GRANULE
    assert not stage.place(("a",), (ROW_GRANULE,)).rebuild  # the row's last slot
    placement = stage.place(("a",), (ROW_GRANULE + 1,))
    assert placement.rebuild and placement.row_len == 2 * ROW_GRANULE


def test_a_batch_that_does_not_fit_is_refused_and_forgotten():
    stage = DecodeStage(first_slot=0, capacity=2 * ROW_GRANULE)
    assert stage.place(("a", "b", "c"), (50, 60, 70)) is None  # 3 rows of 70 > 128 slots
    small = stage.place(("a", "b"), (40, 50))
    assert small.rebuild and small.row_len == ROW_GRANULE


def test_a_step_without_the_batch_forgets_it():
    stage = DecodeStage(first_slot=0, capacity=4 * ROW_GRANULE)
    stage.place(("a", "b"), (10, 20))
    stage.reset()  # e.g. a step of prefills only; "a" may since have finished and come back
    assert stage.place(("a", "b"), (11, 21)).rebuild
