"""The row buffer's bookkeeping: when a batch appends, is rebuilt, or is gathered."""

from __future__ import annotations

from shoal.engine.kv.row_buffer import ROW_GRANULE, RowBuffer


def test_a_steady_batch_is_built_once_then_appends():
    buffer = RowBuffer(first_slot=1000, capacity=4 * ROW_GRANULE)
    first = buffer.fit(("a", "b"), (10, 20))
    assert first.rebuild and first.first == 1000 and first.row_len == ROW_GRANULE
    for grown in range(1, 5):
        layout = buffer.fit(("a", "b"), (10 + grown, 20 + grown))
        assert not layout.rebuild and layout.row_len == ROW_GRANULE


def test_any_change_of_the_batch_rebuilds():
    buffer = RowBuffer(first_slot=0, capacity=8 * ROW_GRANULE)
    buffer.fit(("a", "b"), (10, 20))
    assert buffer.fit(("a", "b", "c"), (11, 21, 5)).rebuild  # a request joined
    assert buffer.fit(("a", "c"), (12, 6)).rebuild  # one left
    assert buffer.fit(("c", "a"), (7, 13)).rebuild  # same requests, other order
    assert buffer.fit(("c", "a"), (9, 14)).rebuild  # a row did not grow by exactly one


def test_a_full_row_is_rebuilt_longer():
    buffer = RowBuffer(first_slot=0, capacity=8 * ROW_GRANULE)
    assert buffer.fit(("a",), (ROW_GRANULE - 1,)).row_len == ROW_GRANULE
    assert not buffer.fit(("a",), (ROW_GRANULE,)).rebuild  # the row's last slot
    layout = buffer.fit(("a",), (ROW_GRANULE + 1,))
    assert layout.rebuild and layout.row_len == 2 * ROW_GRANULE


def test_a_batch_that_does_not_fit_is_refused_and_forgotten():
    buffer = RowBuffer(first_slot=0, capacity=2 * ROW_GRANULE)
    assert buffer.fit(("a", "b", "c"), (50, 60, 70)) is None  # 3 rows of 70 > 128 slots
    small = buffer.fit(("a", "b"), (40, 50))
    assert small.rebuild and small.row_len == ROW_GRANULE


def test_a_step_without_the_batch_forgets_it():
    buffer = RowBuffer(first_slot=0, capacity=4 * ROW_GRANULE)
    buffer.fit(("a", "b"), (10, 20))
    buffer.reset()  # e.g. a step of prefills only; "a" may since have finished and come back
    assert buffer.fit(("a", "b"), (11, 21)).rebuild
