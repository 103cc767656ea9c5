"""Which instance holds which prefix KV blocks, as every node's router sees it (pure).

Each instance's serving rank publishes PrefixUpdates: the chained block hashes its prefix
cache gained and lost (batched), the routing keys of prompts it admitted (routing_keys.py)
each paired with the hash of that prompt's last full block, and the sessions it served. A
snapshot replaces what was known of the instance; a delta adds to it. Every table is an
LRU with a bound, so an instance costs bounded memory whatever it publishes.

A pipeline or tensor instance's ranks keep the same block ids as rank 0 (rank 0 schedules),
so rank 0's hashes stand for every rank; `compat` says what must match for blocks to move
(weights, every rank's KV layout and dtype, block size, the split), and blocks move only
between equal values of it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shoal.cluster.instances import Frozen
from shoal.ids import NodeId


class PrefixUpdate(Frozen):
    """What one instance's serving rank holds now (snapshot) or changed since its last
    update (delta)."""

    instance_id: str
    node_id: NodeId
    compat: str
    seq: int
    snapshot: bool = False
    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    anchors: tuple[tuple[bytes, bytes], ...] = ()  # (routing key, block hash)
    sessions: tuple[bytes, ...] = ()  # session keys, oldest first


@dataclass(frozen=True)
class IndexLimits:
    max_blocks: int = 131_072  # per instance: 2 MiB of hashes, 2M tokens at 16 per block
    max_anchors: int = 32_768  # per instance
    max_sessions: int = 65_536  # in all

    def __post_init__(self) -> None:
        for name in ("max_blocks", "max_anchors", "max_sessions"):
            if getattr(self, name) < 1:
                raise ValueError(f"prefix index {name} must be >= 1")


def _bounded_put(table: OrderedDict, key, value, limit: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)


@dataclass
class InstancePrefixes:
    """One instance's published holdings."""

    node_id: NodeId
    compat: str
    seq: int = -1
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    anchors: OrderedDict[bytes, bytes] = field(default_factory=OrderedDict)

    def apply(self, update: PrefixUpdate, limits: IndexLimits) -> None:
        if update.snapshot:
            self.blocks.clear()
            self.anchors.clear()
        self.node_id, self.compat, self.seq = update.node_id, update.compat, update.seq
        for block_hash in update.removed:
            self.blocks.pop(block_hash, None)
        for block_hash in update.stored:
            _bounded_put(self.blocks, block_hash, None, limits.max_blocks)
        for key, block_hash in update.anchors:
            _bounded_put(self.anchors, key, block_hash, limits.max_anchors)

    def held_run(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of block_hashes this instance holds."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.blocks:
                break
            count += 1
        return count

    def matched_keys(self, keys: Sequence[bytes]) -> int:
        """How many leading routing keys lead to a block this instance still holds (the
        deepest such key counts; keys chain, so it implies all before it)."""
        for index in range(len(keys) - 1, -1, -1):
            block_hash = self.anchors.get(keys[index])
            if block_hash is not None and block_hash in self.blocks:
                return index + 1
        return 0


class PrefixIndex:
    def __init__(self, limits: IndexLimits | None = None) -> None:
        self.limits = limits or IndexLimits()
        self._instances: dict[str, InstancePrefixes] = {}
        # session key -> the instance that served it last (a newer sighting wins)
        self._sessions: OrderedDict[bytes, str] = OrderedDict()

    def __contains__(self, instance_id: str) -> bool:
        return instance_id in self._instances

    def get(self, instance_id: str) -> InstancePrefixes | None:
        return self._instances.get(instance_id)

    def apply(self, update: PrefixUpdate) -> None:
        entry = self._instances.get(update.instance_id)
        if entry is None:
            entry = self._instances[update.instance_id] = InstancePrefixes(
                update.node_id, update.compat)
        entry.apply(update, self.limits)
        for session in update.sessions:
            if update.snapshot and session in self._sessions:
                continue  # a snapshot repeats old sightings: they must not undo newer ones
            self.pin(session, update.instance_id)

    def pin(self, session: bytes, instance_id: str) -> None:
        """The session just went to instance_id (a router knows before the runner says)."""
        _bounded_put(self._sessions, session, instance_id, self.limits.max_sessions)

    def retain(self, instance_ids: Iterable[str]) -> None:
        """Forget every instance not in instance_ids (deleted, or its node gone)."""
        keep = set(instance_ids)
        for instance_id in [i for i in self._instances if i not in keep]:
            del self._instances[instance_id]

    def session_instance(self, session: bytes) -> str | None:
        """The instance that served the session last, as far as this node heard."""
        return self._sessions.get(session)

    def matched_keys(self, instance_id: str, keys: Sequence[bytes]) -> int:
        entry = self._instances.get(instance_id)
        return entry.matched_keys(keys) if entry is not None and keys else 0

    def best_holder(self, block_hashes: Sequence[bytes], compat: str,
                    exclude: str | None = None) -> tuple[str, InstancePrefixes, int] | None:
        """(instance id, its holdings, blocks held) of the compatible instance holding the
        longest leading run of block_hashes; None if none holds the first."""
        best: tuple[str, InstancePrefixes, int] | None = None
        for instance_id, entry in sorted(self._instances.items()):
            if instance_id == exclude or entry.compat != compat:
                continue
            held = entry.held_run(block_hashes)
            if held and (best is None or held > best[2]):
                best = (instance_id, entry, held)
        return best
