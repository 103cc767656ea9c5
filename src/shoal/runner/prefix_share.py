"""The runner's side of prefix KV between nodes (the node's side: cluster/prefix_share.py).

- Reports: what the prefix cache gained and lost, with the routing keys and sessions of the
  prompts admitted, goes to the supervisor at most every report_interval_s (PrefixReport).
- Fetching: a new request whose prompt has at least min_blocks full blocks not cached here
  is held back (PrefixWanted). Parts that arrive are imported at once, each checked against
  the request's own block hashes (so only the prefix asked for can enter) and verified by
  the engine (hash chain, shapes, dtypes, finite values). The request is admitted when the
  supervisor says the fetch is over, or at fetch_wait_s at the latest: it then prefills
  whatever did not arrive, so a slow or dead holder costs an ordinary prefill.
- Exporting: PrefixExport is answered at once with the blocks held, in parts.

A split instance's runner is rank 0's: it reports the hashes (it schedules for all ranks),
and its blocks carry every rank's share (engine/kv/transfer.py), so they move only between
instances split the same way (compat_key).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.engine.core import EngineCore
from shoal.engine.kv.prefix_cache import extend_block_hashes
from shoal.protocol import GenerationRequest
from shoal.routing_keys import prefix_keys, session_key
from shoal.runner.prefix_messages import (
    PrefixExport,
    PrefixExportPart,
    PrefixFetched,
    PrefixPart,
    PrefixReport,
    PrefixWanted,
)

log = logging.getLogger("shoal.runner.prefix")

_FINGERPRINT_BYTES = 1024 * 1024


@dataclass
class HeldRequest:
    """A request waiting for its prefix blocks."""

    request: GenerationRequest
    token_ids: list[int]
    block_hashes: list[bytes]
    deadline: float
    imported_blocks: int = 0
    started: float = field(default_factory=time.monotonic)


def weights_fingerprint(path: Path) -> str:
    """A cheap identity of a model's weights: size and the first and last MiB of each file
    (a GGUF's header names every tensor and its offset), equal on every machine."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.blake2b(digest_size=12)
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size};".encode())
        with open(file, "rb") as handle:
            digest.update(handle.read(_FINGERPRINT_BYTES))
            handle.seek(max(0, size - _FINGERPRINT_BYTES))
            digest.update(handle.read(_FINGERPRINT_BYTES))
    return digest.hexdigest()


def compat_key(engine: EngineCore) -> str:
    """What two instances must share to exchange prefix blocks: weights, block size, and how
    the model is split and its KV laid out (engine.kv_layout_key)."""
    config = engine.config
    return (f"{config.source.model_id}|{weights_fingerprint(Path(config.source.path))}|"
            f"bs{config.block_size}|{engine.kv_layout_key()}")


class RunnerPrefixShare:
    def __init__(self, engine: EngineCore, send: Callable[[Any], None],
                 report_interval_s: float = 0.25, fetch_wait_s: float = 8.0,
                 min_blocks: int = 4) -> None:
        pool = engine.prefix_pool()
        if pool is None:
            raise ValueError(f"{engine.model_id} has no prefix cache to share")
        self.engine = engine
        self._send = send
        self._pool = pool
        self.block_size = engine.config.block_size
        self.report_interval_s = report_interval_s
        self.fetch_wait_s = fetch_wait_s
        self.min_blocks = min_blocks
        self.compat = compat_key(engine)
        self._anchors: list[tuple[bytes, bytes]] = []
        self._sessions: list[bytes] = []
        self._last_report = 0.0
        self.held: dict[str, HeldRequest] = {}

    @classmethod
    def for_engine(cls, engine: EngineCore,
                   send: Callable[[Any], None]) -> RunnerPrefixShare | None:
        """The share of an engine with a prefix cache; None otherwise (an embedding model,
        prefix caching off, a test's fake engine)."""
        return None if engine.prefix_pool() is None else cls(engine, send)

    # ---- reports ------------------------------------------------------------------------

    def admitted(self, request: GenerationRequest, token_ids: list[int]) -> None:
        """A request entered the engine: its routing keys lead to its last full block."""
        full = len(token_ids) // self.block_size
        if full:
            last = extend_block_hashes([], token_ids[:full * self.block_size],
                                       self.block_size)[-1]
            self._anchors.extend((key, last) for key in prefix_keys(request))
        if request.session_id is not None:
            self._sessions.append(session_key(request.session_id))

    def _dirty(self) -> bool:
        return bool(self._anchors or self._sessions or self._pool.prefix_cache.has_changes)

    def maybe_report(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now - self._last_report < self.report_interval_s or not self._dirty():
            return
        self._last_report = now
        stored, removed = self._pool.prefix_cache.drain_changes()
        anchors, self._anchors = self._anchors, []
        sessions, self._sessions = self._sessions, []
        self._send(PrefixReport(compat=self.compat, stored=tuple(stored),
                                removed=tuple(removed), anchors=tuple(anchors),
                                sessions=tuple(sessions)))

    def wait_s(self, now: float | None = None) -> float | None:
        """How long the loop may sleep before a report or a held request is due."""
        now = time.monotonic() if now is None else now
        waits = [h.deadline - now for h in self.held.values()]
        if self._dirty():
            waits.append(self._last_report + self.report_interval_s - now)
        return max(0.0, min(waits)) if waits else None

    # ---- fetching -----------------------------------------------------------------------

    def hold(self, request: GenerationRequest, token_ids: list[int]) -> bool:
        """Hold request for a fetch when enough of its prompt's blocks are missing here;
        False: admit it now."""
        if request.request_id in self.held:
            return False
        # The scheduler leaves the prompt's last token to compute (it yields the logits).
        usable = (len(token_ids) - 1) // self.block_size
        if usable < self.min_blocks:
            return False
        hashes = extend_block_hashes([], token_ids[:usable * self.block_size], self.block_size)
        have = len(self._pool.find_cached(hashes))
        if usable - have < self.min_blocks:
            return False
        self.held[request.request_id] = HeldRequest(
            request, token_ids, hashes, time.monotonic() + self.fetch_wait_s)
        self._send(PrefixWanted(request_id=request.request_id, compat=self.compat,
                                block_hashes=tuple(hashes), have_blocks=have,
                                token_ids=tuple(token_ids[:usable * self.block_size])))
        return True

    def on_part(self, message: PrefixPart) -> None:
        # torch: only a runner that serves a real engine receives blocks
        from shoal.engine.kv.transfer import TransferError
        from shoal.runner.kv_wire import blocks_from_wire

        held = self.held.get(message.request_id)
        if held is None:
            return  # the fetch ended already
        try:
            blocks = blocks_from_wire(message.blocks)
            start = held.block_hashes.index(blocks.block_hashes[0]) \
                if blocks.block_hashes and blocks.block_hashes[0] in held.block_hashes else -1
            if start < 0 or tuple(held.block_hashes[start:start + blocks.num_blocks]) \
                    != blocks.block_hashes:
                raise TransferError("the blocks are not the ones this request asked for")
            held.imported_blocks += self.engine.import_prefix(blocks)
        except TransferError as error:
            log.warning("prefix blocks for %s refused: %s", message.request_id, error)

    def on_fetched(self, message: PrefixFetched) -> HeldRequest | None:
        """The held request to admit now, if it is still held."""
        held = self.held.pop(message.request_id, None)
        if held is not None:
            log.info("prefix fetch for %s: %s, %d blocks imported in %.3f s",
                     message.request_id, message.outcome, held.imported_blocks,
                     time.monotonic() - held.started)
        return held

    def overdue(self, now: float | None = None) -> list[HeldRequest]:
        """Held requests whose wait ran out: admit them with what arrived."""
        now = time.monotonic() if now is None else now
        late = [rid for rid, held in self.held.items() if held.deadline <= now]
        for request_id in late:
            log.warning("prefix fetch for %s gave no answer within %.1f s; prefilling",
                        request_id, self.fetch_wait_s)
        return [self.held.pop(rid) for rid in late]

    def cancel(self, request_id: str) -> bool:
        """Drop a held request; False when it is not held."""
        return self.held.pop(request_id, None) is not None

    # ---- exporting ----------------------------------------------------------------------

    def export(self, message: PrefixExport) -> None:
        """Answer at once: the blocks held of message.token_ids, from start_block on."""
        from shoal.runner.kv_wire import blocks_to_wire, split_blocks  # torch, as above

        def part(seq: int, last: bool, **fields: Any) -> None:
            self._send(PrefixExportPart(export_id=message.export_id, seq=seq, last=last,
                                        **fields))

        if message.compat != self.compat:
            part(0, True, error="this instance's blocks do not fit the asker's cache")
            return
        blocks = self.engine.export_prefix(list(message.token_ids))
        if blocks is None or blocks.num_blocks <= message.start_block:
            part(0, True, error="no blocks of that prefix are held here any more")
            return
        parts = split_blocks(blocks, message.start_block)
        for seq, piece in enumerate(parts):
            part(seq, seq == len(parts) - 1, blocks=blocks_to_wire(piece))
