"""The disk event log: append, read back, rotate, bound, survive damage and a full disk."""

from __future__ import annotations

import errno
import logging

import pytest
import zstandard
from state_builders import indexed, node

from shoal.cluster import event_log as event_log_module
from shoal.cluster.event_log import (
    LIVE_NAME,
    CorruptEventLog,
    EventLog,
    EventsUnavailable,
    encode_record,
    read_records,
)
from shoal.cluster.events import IndexedEvent, NodeJoined


def events(count: int, start: int = 0) -> list[IndexedEvent]:
    return indexed([NodeJoined(node=node(f"n{i}")) for i in range(start, start + count)],
                   start=start)


def fill(log: EventLog, items: list[IndexedEvent]) -> None:
    for item in items:
        log.append(item)


def test_append_then_read_back_everything_and_from_an_index(tmp_path):
    log = EventLog(tmp_path)
    written = events(10)
    fill(log, written)
    assert list(log.read()) == written
    assert list(log.read(7)) == written[7:]
    assert list(log.read(10)) == []
    assert (log.appended, log.last_idx) == (10, 9)
    log.close()
    assert list(read_records(tmp_path / LIVE_NAME)) == written


def test_append_refuses_a_gap(tmp_path):
    log = EventLog(tmp_path)
    log.append(events(1)[0])
    with pytest.raises(ValueError, match="expected index 1"):
        log.append(events(1, start=2)[0])


def test_rotation_compresses_and_reads_across_archives(tmp_path):
    record = len(encode_record(events(1)[0]))
    log = EventLog(tmp_path, rotate_bytes=record * 3, max_archives=100)
    written = events(10)
    fill(log, written)
    archives = sorted(tmp_path.glob("events.*.bin.zst"))
    assert len(archives) == 3  # 3 + 3 + 3 rotated, 1 left live
    # Archives are real zstd frames holding the records.
    raw = zstandard.ZstdDecompressor().decompress(archives[0].read_bytes(),
                                                  max_output_size=10 * record)
    assert raw == b"".join(encode_record(e) for e in written[:3])
    assert list(log.read()) == written
    assert list(log.read(4)) == written[4:]


def test_archives_are_bounded_by_count(tmp_path):
    record = len(encode_record(events(1)[0]))
    log = EventLog(tmp_path, rotate_bytes=record * 2, max_archives=2)
    written = events(11)
    fill(log, written)
    assert len(list(tmp_path.glob("events.*.bin.zst"))) == 2
    with pytest.raises(EventsUnavailable, match="rotated out"):
        list(log.read(0))
    assert list(log.read(6)) == written[6:]


def test_archives_are_bounded_by_bytes(tmp_path):
    record = len(encode_record(events(1)[0]))
    probe = EventLog(tmp_path / "probe", rotate_bytes=record * 2)
    fill(probe, events(2))
    one_archive = next((tmp_path / "probe").glob("*.zst")).stat().st_size
    log = EventLog(tmp_path / "log", rotate_bytes=record * 2, max_archives=100,
                   max_archive_bytes=int(one_archive * 2.5))
    fill(log, events(12))
    archives = list((tmp_path / "log").glob("*.zst"))
    assert len(archives) == 2
    assert sum(a.stat().st_size for a in archives) <= one_archive * 2.5


def test_reopening_archives_the_previous_session(tmp_path):
    first = EventLog(tmp_path)
    old = events(4)
    fill(first, old)
    first.close()
    second = EventLog(tmp_path)
    new = events(2)
    fill(second, new)
    assert list(second.read()) == new  # a new session indexes from 0 again
    (archive,) = tmp_path.glob("events.*.bin.zst")
    assert list(read_records(archive)) == old


def test_a_truncated_tail_is_ignored(tmp_path, caplog):
    log = EventLog(tmp_path)
    written = events(3)
    fill(log, written)
    log.close()
    live = tmp_path / LIVE_NAME
    data = live.read_bytes()
    for cut in (3, len(encode_record(written[2])) - 2):  # inside the header, inside the body
        live.write_bytes(data[:-cut])
        with caplog.at_level(logging.WARNING, logger="shoal.event_log"):
            assert list(read_records(live)) == written[:2]
        assert "cut short" in caplog.text


def test_a_truncated_tail_survives_archiving_on_reopen(tmp_path):
    log = EventLog(tmp_path)
    written = events(3)
    fill(log, written)
    log.close()
    live = tmp_path / LIVE_NAME
    live.write_bytes(live.read_bytes()[:-5])
    EventLog(tmp_path).close()
    (archive,) = tmp_path.glob("*.zst")
    assert list(read_records(archive)) == written[:2]


def test_a_damaged_record_in_the_middle_raises(tmp_path):
    log = EventLog(tmp_path)
    fill(log, events(3))
    log.close()
    live = tmp_path / LIVE_NAME
    data = bytearray(live.read_bytes())
    first = len(encode_record(events(1)[0]))
    data[first + 4:first + 8] = b"\xc1\xc1\xc1\xc1"  # 0xc1 is never valid msgpack
    live.write_bytes(bytes(data))
    with pytest.raises(CorruptEventLog, match=f"byte {first}"):
        list(read_records(live))


class FullDisk:
    """A file that accepts `room` bytes, then fails every write with ENOSPC."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> int:
        if len(self.data) + len(data) > self.room:
            self.data += data[:self.room - len(self.data)]
            raise OSError(errno.ENOSPC, "No space left on device")
        self.data += data
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_a_full_disk_degrades_to_counting_with_one_critical_line(tmp_path, caplog):
    record = len(encode_record(events(1)[0]))
    disk = FullDisk(room=record * 2 + 3)
    log = EventLog(tmp_path, opener=lambda path, mode: disk)
    with caplog.at_level(logging.CRITICAL, logger="shoal.event_log"):
        fill(log, events(6))
    critical = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(critical) == 1 and "No space left" in critical[0].getMessage()
    assert log.degraded and disk.closed
    assert (log.appended, log.last_idx) == (6, 5)  # indices keep advancing
    log.append(events(1, start=6)[0])
    assert log.appended == 7
    with pytest.raises(EventsUnavailable, match="degraded"):
        list(log.read())


def test_a_failure_at_open_degrades_from_the_start(tmp_path, caplog):
    def no_space(path, mode):
        raise OSError(errno.ENOSPC, "No space left on device")

    with caplog.at_level(logging.CRITICAL, logger="shoal.event_log"):
        log = EventLog(tmp_path, opener=no_space)
        fill(log, events(3))
    assert log.degraded and log.last_idx == 2
    assert len([r for r in caplog.records if r.levelno == logging.CRITICAL]) == 1


def test_free_space_below_the_floor_degrades_before_the_disk_fills(tmp_path, monkeypatch):
    monkeypatch.setattr(event_log_module, "FREE_SPACE_CHECK_EVERY", 4)
    monkeypatch.setattr(event_log_module.shutil, "disk_usage",
                        lambda path: type("Usage", (), {"free": 1000})())
    log = EventLog(tmp_path, min_free_bytes=10_000)
    fill(log, events(3))
    assert not log.degraded
    fill(log, events(2, start=3))
    assert log.degraded and "floor" in log.degraded_reason
    log.close()
    assert len(list(read_records(tmp_path / LIVE_NAME))) == 4  # written before the check
