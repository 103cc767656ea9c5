"""The master's append-only event log on disk.

Records are a 4-byte big-endian length then msgpack of IndexedEvent (to_wire). The live file
`events.bin` is plain; past `rotate_bytes` it is compressed with zstd into
`events.<seq>.bin.zst`, and archives are deleted oldest first to stay within `max_archives`
and `max_archive_bytes`. Opening the log archives a previous session's live file.

The disk is bounded: any write failure (ENOSPC above all), or free space falling below
`min_free_bytes`, drops the log into counting-only mode with exactly one CRITICAL line.
Indices keep advancing, so the cluster carries on; only durability is lost.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import msgpack
import pydantic
import zstandard

from shoal.cluster.events import IndexedEvent, parse_indexed_event, to_wire

log = logging.getLogger("shoal.event_log")

LIVE_NAME = "events.bin"
_HEADER = struct.Struct(">I")
# No event comes near this; a bigger length prefix means the file is damaged.
MAX_RECORD_BYTES = 64 * 2**20
# Free space is checked once per this many appends (a statvfs per event is wasteful).
FREE_SPACE_CHECK_EVERY = 1024

Opener = Callable[[Path, str], BinaryIO]


class CorruptEventLog(ValueError):
    """A complete record that does not decode: the file is damaged, not merely cut short."""


class EventsUnavailable(LookupError):
    """The events asked for were rotated out (or never written: the log is degraded)."""


def encode_record(indexed: IndexedEvent) -> bytes:
    body = msgpack.packb(to_wire(indexed), use_bin_type=True)
    return _HEADER.pack(len(body)) + body


def read_records(path: Path) -> Iterator[IndexedEvent]:
    """Every complete record of a live (.bin) or archived (.bin.zst) file, in order.

    A record cut short at the end (a crash or a full disk mid-write) ends the iteration
    with a warning; an undecodable complete record raises CorruptEventLog.
    """
    with open(path, "rb") as raw:
        if path.suffix == ".zst":
            with zstandard.ZstdDecompressor().stream_reader(raw) as stream:
                yield from _decode_stream(stream, path)
        else:
            yield from _decode_stream(raw, path)


def _decode_stream(stream: BinaryIO, path: Path) -> Iterator[IndexedEvent]:
    offset = 0
    while True:
        header = _read_exact(stream, _HEADER.size)
        if not header:
            return
        if len(header) < _HEADER.size:
            log.warning("%s: record at byte %d is cut short; ignoring the tail", path, offset)
            return
        (length,) = _HEADER.unpack(header)
        if length > MAX_RECORD_BYTES:
            raise CorruptEventLog(f"{path}: record at byte {offset} claims {length} bytes")
        body = _read_exact(stream, length)
        if len(body) < length:
            log.warning("%s: record at byte %d is cut short; ignoring the tail", path, offset)
            return
        try:
            yield parse_indexed_event(msgpack.unpackb(body, raw=False))
        except (ValueError, msgpack.UnpackException, pydantic.ValidationError) as error:
            raise CorruptEventLog(f"{path}: record at byte {offset}: {error}") from error
        offset += _HEADER.size + length


def _read_exact(stream: BinaryIO, size: int) -> bytes:
    """Up to size bytes; fewer only at end of stream (decompressors may return short reads)."""
    chunks, remaining = [], size
    while remaining:
        chunk = stream.read(remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


class EventLog:
    """Append-only, rotating, bounded log of one master session's indexed events."""

    def __init__(self, directory: Path, *, rotate_bytes: int = 64 * 2**20,
                 max_archives: int = 5, max_archive_bytes: int = 2**30,
                 min_free_bytes: int = 256 * 2**20, opener: Opener = open) -> None:
        if rotate_bytes < 1 or max_archives < 0 or max_archive_bytes < 0 or min_free_bytes < 0:
            raise ValueError("event log bounds must be positive")
        self.directory = Path(directory)
        self.rotate_bytes = rotate_bytes
        self.max_archives = max_archives
        self.max_archive_bytes = max_archive_bytes
        self.min_free_bytes = min_free_bytes
        self._opener = opener
        self._file: BinaryIO | None = None
        self._live_bytes = 0
        self._session_archives: list[Path] = []
        self.appended = 0
        self.last_idx: int | None = None
        self.degraded_reason: str | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._next_seq = max((seq for seq, _ in self._archives()), default=-1) + 1
            live = self.directory / LIVE_NAME
            if live.exists() and live.stat().st_size > 0:
                self._archive_live(session=False)
            self._file = self._opener(live, "wb")
        except OSError as error:
            self._degrade(error)

    @property
    def degraded(self) -> bool:
        return self.degraded_reason is not None

    @property
    def live_path(self) -> Path:
        return self.directory / LIVE_NAME

    def append(self, indexed: IndexedEvent) -> None:
        """Persist one event (flushed to the OS before returning) unless degraded.

        Indices must be contiguous: the master is the only indexer, so a gap is its bug.
        """
        expected = 0 if self.last_idx is None else self.last_idx + 1
        if indexed.idx != expected:
            raise ValueError(f"event log expected index {expected}, got {indexed.idx}")
        self.last_idx = indexed.idx
        self.appended += 1
        if self._file is None:
            return
        try:
            record = encode_record(indexed)
            self._file.write(record)
            self._file.flush()
            self._live_bytes += len(record)
            if self._live_bytes >= self.rotate_bytes:
                self._rotate()
            elif self.appended % FREE_SPACE_CHECK_EVERY == 0:
                self._check_free_space()
        except OSError as error:
            self._degrade(error)

    def read(self, start_idx: int = 0) -> Iterator[IndexedEvent]:
        """This session's events with idx >= start_idx, oldest first.

        EventsUnavailable when start_idx was rotated out, or the log is degraded.
        """
        if self.degraded:
            raise EventsUnavailable(f"the event log is degraded ({self.degraded_reason})")
        files = [p for p in self._session_archives if p.exists()] + [self.live_path]
        first = True
        for path in files:
            for indexed in read_records(path):
                if first and indexed.idx > start_idx:
                    raise EventsUnavailable(f"events before {indexed.idx} were rotated out; "
                                            f"asked for {start_idx}")
                first = False
                if indexed.idx >= start_idx:
                    yield indexed
        if first and self.last_idx is not None and start_idx <= self.last_idx:
            raise EventsUnavailable(f"no events on disk; asked for {start_idx}")

    def close(self) -> None:
        """Flush, fsync and close the live file; it is archived when the log next opens."""
        if self._file is None:
            return
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except (OSError, ValueError, AttributeError):
            pass  # best effort: a fake or failing file still gets closed below
        finally:
            self._file.close()
            self._file = None

    # -- rotation ----------------------------------------------------------------------

    def _archives(self) -> list[tuple[int, Path]]:
        found = []
        for path in self.directory.glob("events.*.bin.zst"):
            seq = path.name.split(".")[1]
            if seq.isdigit():
                found.append((int(seq), path))
        return sorted(found)

    def _rotate(self) -> None:
        self.close()
        self._archive_live(session=True)
        self._file = self._opener(self.live_path, "wb")
        self._live_bytes = 0

    def _archive_live(self, session: bool) -> None:
        """Compress the live file into the next archive (atomically), then bound archives."""
        target = self.directory / f"events.{self._next_seq:06d}.bin.zst"
        partial = target.with_suffix(".zst.partial")
        self._next_seq += 1
        try:
            with open(self.live_path, "rb") as source, open(partial, "wb") as sink:
                zstandard.ZstdCompressor(level=3).copy_stream(source, sink)
                sink.flush()
                os.fsync(sink.fileno())
        except OSError:
            partial.unlink(missing_ok=True)
            raise
        partial.replace(target)
        self.live_path.unlink()
        if session:
            self._session_archives.append(target)
        self._enforce_bounds()

    def _enforce_bounds(self) -> None:
        archives = self._archives()
        total = sum(path.stat().st_size for _, path in archives)
        while archives and (len(archives) > self.max_archives or total > self.max_archive_bytes):
            _, oldest = archives.pop(0)
            total -= oldest.stat().st_size
            oldest.unlink()

    def _check_free_space(self) -> None:
        if not self.min_free_bytes:
            return
        free = shutil.disk_usage(self.directory).free
        if free < self.min_free_bytes:
            raise OSError(errno.ENOSPC, f"only {free} bytes free, below the "
                                        f"{self.min_free_bytes}-byte floor")

    def _degrade(self, error: OSError) -> None:
        if self.degraded:
            return
        self.degraded_reason = str(error)
        log.critical("event log in %s stopped persisting (%s); events are only counted from "
                     "now on, and late joiners can sync from a snapshot only",
                     self.directory, error)
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass
