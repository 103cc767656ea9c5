"""The SSD tier: full prefix blocks kept as files in one directory, bounded (LRU) and aged (TTL).

One directory per (weights, layer range, KV dtype, block size, rank): kv/disk_prefixes.py
names it. Each block is one file named by its chained hash (disk_format.py), written by a
background thread through a temporary file and a rename, so a reader never sees half a file.
The index (hash -> size, in least-recently-used order) is rebuilt from the directory at start:
leftover temporary files and files that are cut short or unreadable are removed, and so are
entries unused for longer than the TTL.

Nothing here may stall a step: saving only queues (a full queue drops the block), and a
read is waited for at most read_timeout_s. A disk that is full, read-only or not ours to
write turns the tier off with one warning; serving goes on without it.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from shoal.engine.kv.disk_format import (
    PREAMBLE_BYTES,
    CorruptBlock,
    decode_block,
    encode_block,
    file_length,
    header_length,
)
from shoal.engine.kv.transfer import PrefixBlocks

log = logging.getLogger("shoal.kv_disk")

SUFFIX = ".kv"
_NAME = re.compile(r"[0-9a-f]{32}\.kv")
# Errors that say the directory cannot take our files at all (as opposed to one bad file).
_DISABLING = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}


class DiskTier:
    """Block files in `directory`, at most max_bytes of them, each kept ttl_s after last use."""

    def __init__(self, directory: Path, max_bytes: int, ttl_s: float, block_size: int,
                 read_timeout_s: float = 2.0, queue_blocks: int = 256,
                 clock: Callable[[], float] = time.time) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.block_size = block_size
        self.read_timeout_s = read_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> bytes, LRU first
        self._used_at: dict[bytes, float] = {}
        self.num_bytes = 0
        self.enabled = True
        self.stats = {"written": 0, "dropped": 0, "loaded": 0, "corrupt": 0, "evicted": 0,
                      "expired": 0, "read_timeouts": 0}
        self._queue: queue.Queue[PrefixBlocks | None] = queue.Queue(maxsize=queue_blocks)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-reader")
        self._reading: Future | None = None
        self._closed = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._rebuild()
        except OSError as error:
            self.disable(error)
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                        daemon=True)
        self._writer.start()

    # ---- queries ------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def has(self, block_hash: bytes) -> bool:
        with self._lock:
            return self.enabled and block_hash in self._index

    def path_of(self, block_hash: bytes) -> Path:
        return self.directory / (block_hash.hex() + SUFFIX)

    # ---- saving (the step's thread queues, the writer thread writes) -------------------

    def save(self, block: PrefixBlocks) -> bool:
        """Queue one block for writing; False when it is already stored, the tier is off or
        the queue is full (the block is dropped: a step never waits on the disk)."""
        if self._closed or not self.enabled or self.has(block.block_hashes[0]):
            return False
        try:
            self._queue.put_nowait(block)
        except queue.Full:
            self.stats["dropped"] += 1
            return False
        return True

    def _write_loop(self) -> None:
        while True:
            block = self._queue.get()
            try:
                if block is None:
                    return
                self._write(block)
            except Exception:  # noqa: BLE001 - one bad block must not end the writer
                log.exception("writing a KV block to %s failed", self.directory)
            finally:
                self._queue.task_done()

    def wait_written(self, timeout_s: float) -> bool:
        """Wait (at most timeout_s) until every queued block is written; whether it was."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def _write(self, block: PrefixBlocks) -> None:
        block_hash = block.block_hashes[0]
        if not self.enabled or self.has(block_hash):
            return
        data = encode_block(block)
        if len(data) > self.max_bytes:
            return
        self._make_room(len(data))
        path = self.path_of(block_hash)
        temporary = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
        try:
            with open(temporary, "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except OSError as error:
            _unlink(temporary)
            if error.errno in _DISABLING:
                self.disable(error)
            else:
                log.warning("could not write KV block %s: %s", path.name, error)
            return
        with self._lock:
            self._index[block_hash] = len(data)
            self._used_at[block_hash] = self._clock()
            self.num_bytes += len(data)
            self.stats["written"] += 1

    def _make_room(self, size: int) -> None:
        """Drop expired entries, then least recently used ones until size more fits."""
        now = self._clock()
        victims = []
        with self._lock:
            while self._index:
                oldest = next(iter(self._index))
                expired = now - self._used_at[oldest] > self.ttl_s
                if not expired and self.num_bytes + size <= self.max_bytes:
                    break
                victims.append(oldest)
                self.stats["expired" if expired else "evicted"] += 1
                self._drop(oldest)
        for block_hash in victims:
            _unlink(self.path_of(block_hash))

    # ---- loading ----------------------------------------------------------------------------

    def load(self, block_hashes: Sequence[bytes], parent_hash: bytes,
             timeout_s: float | None = None) -> list[PrefixBlocks]:
        """The stored blocks that continue parent_hash along block_hashes, in order, up to
        the first one missing or unreadable; waits at most timeout_s (read_timeout_s when
        None), then gives nothing, and no new read starts until that one ends."""
        wait_s = self.read_timeout_s if timeout_s is None else timeout_s
        if wait_s <= 0 or not self.enabled or self._closed or not self.has(block_hashes[0]):
            return []
        if self._reading is not None and not self._reading.done():
            return []  # the disk has not answered the last read yet
        self._reading = self._reader.submit(self._read_chain, list(block_hashes), parent_hash)
        try:
            return self._reading.result(timeout=wait_s)
        except FutureTimeout:
            self.stats["read_timeouts"] += 1
            log.warning("the KV disk tier took over %.1f s to read; computing instead", wait_s)
            return []

    def _read_chain(self, block_hashes: list[bytes], parent_hash: bytes) -> list[PrefixBlocks]:
        blocks: list[PrefixBlocks] = []
        for block_hash in block_hashes:
            if not self._take(block_hash):
                break
            path = self.path_of(block_hash)
            try:
                data = bytearray(path.read_bytes())
                block = decode_block(data, self.block_size)
                if block.block_hashes[0] != block_hash or block.parent_hash != parent_hash:
                    raise CorruptBlock("the file holds another block")
            except (OSError, CorruptBlock) as error:
                log.warning("KV block file %s is unusable (%s); removed", path.name, error)
                self.discard([block_hash])
                self.stats["corrupt"] += 1
                break
            _touch(path)
            blocks.append(block)
            parent_hash = block_hash
        self.stats["loaded"] += len(blocks)
        return blocks

    def _take(self, block_hash: bytes) -> bool:
        """Whether block_hash is stored and fresh; marks it used (an expired one is removed)."""
        now = self._clock()
        with self._lock:
            if block_hash not in self._index:
                return False
            if now - self._used_at[block_hash] <= self.ttl_s:
                self._index.move_to_end(block_hash)
                self._used_at[block_hash] = now
                return True
            self._drop(block_hash)
            self.stats["expired"] += 1
        _unlink(self.path_of(block_hash))
        return False

    def discard(self, block_hashes: Sequence[bytes]) -> None:
        """Forget and remove blocks (found unusable)."""
        for block_hash in block_hashes:
            with self._lock:
                if block_hash in self._index:
                    self._drop(block_hash)
            _unlink(self.path_of(block_hash))

    # ---- lifecycle -------------------------------------------------------------------------

    def disable(self, error: OSError) -> None:
        """Turn the tier off (once, with one warning): the disk cannot take our files."""
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
        log.warning("the KV disk tier at %s is off: %s; serving goes on without it",
                    self.directory, error)

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Write what is queued (for at most flush_timeout_s), then stop both threads."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + flush_timeout_s
        try:
            self._queue.put(None, timeout=flush_timeout_s)
        except queue.Full:
            log.warning("the KV disk tier's queue did not drain in %.0f s; %d blocks unsaved",
                        flush_timeout_s, self._queue.qsize())
        self._writer.join(max(deadline - time.monotonic(), 0.0))
        self._reader.shutdown(wait=False, cancel_futures=True)

    def _rebuild(self) -> None:
        """The index from the directory: the sound files, least recently used first."""
        now = self._clock()
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".tmp"):  # a write cut off by a crash
                _unlink(Path(entry.path))
                continue
            if not _NAME.fullmatch(entry.name):
                continue
            stat = entry.stat()
            if now - stat.st_mtime > self.ttl_s:
                self.stats["expired"] += 1
                _unlink(Path(entry.path))
            elif not _sound(Path(entry.path), stat.st_size):
                log.warning("KV block file %s is cut short or unreadable; removed", entry.name)
                self.stats["corrupt"] += 1
                _unlink(Path(entry.path))
            else:
                found.append((stat.st_mtime, bytes.fromhex(entry.name[:-len(SUFFIX)]),
                              stat.st_size))
        for used_at, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self._used_at[block_hash] = used_at
            self.num_bytes += size
        self._make_room(0)

    def _drop(self, block_hash: bytes) -> None:  # the lock is held
        self.num_bytes -= self._index.pop(block_hash)
        del self._used_at[block_hash]


def _sound(path: Path, size: int) -> bool:
    """Whether a block file's header reads and promises exactly its size (checksums are
    checked when the block is read, not at start: that would read the whole tier)."""
    try:
        with open(path, "rb") as file:
            preamble = file.read(PREAMBLE_BYTES)
            header = file.read(header_length(preamble))
        return file_length(preamble + header) == size
    except (OSError, CorruptBlock):
        return False


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as error:
        log.debug("could not remove %s: %s", path, error)


def _touch(path: Path) -> None:
    """Record a use in the file's time, so LRU order and the TTL survive a restart."""
    try:
        os.utime(path)
    except OSError:
        pass
