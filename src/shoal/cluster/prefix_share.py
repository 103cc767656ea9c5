"""Prefix KV between nodes, the node's side (the runner's: runner/prefix_share.py).

Publication: this node's serving runners report their prefix caches' changes; every
publish_interval_s the changes of each instance go out as one PrefixUpdate delta on the
prefixes topic, and every snapshot_interval_s (and soon after the set of peers changes) a
snapshot of all it holds, which repairs deltas a node dropped or joined too late to see.
Every node keeps what it hears in a PrefixIndex that the router reads.

Fetching, over the data plane: a runner asks for a request's missing prefix blocks; this
node asks the compatible instance holding the longest run of them ({"kv_fetch"} to its
node); that node has its runner export them and sends the parts back ({"kv_part"}, seq from
0, the last one marked). Each part goes to the asking runner as it comes; the runner always
hears that the fetch is over, at the latest when a bound runs out (first_part_s for the
first part, part_gap_s between parts, fetch_s in all): a slow or vanished holder costs an
ordinary prefill, never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pydantic

from shoal.cluster.background import cancel_and_wait
from shoal.cluster.data_plane import KV_FETCH_FIELD, KV_PART_FIELD
from shoal.cluster.prefix_index import IndexLimits, PrefixIndex, PrefixUpdate
from shoal.cluster.state import ClusterState
from shoal.cluster.transport.base import Subscription, Transport, TransportError
from shoal.cluster.transport.topics import Topic
from shoal.ids import NodeId
from shoal.runner.prefix_messages import (
    PrefixExport,
    PrefixExportPart,
    PrefixFetched,
    PrefixPart,
    PrefixReport,
    PrefixWanted,
)
from shoal.runner.registry import RunnerKey, RunnerRegistry

log = logging.getLogger("shoal.cluster.prefix")


@dataclass(frozen=True)
class ShareConfig:
    publish_interval_s: float = 0.25
    snapshot_interval_s: float = 15.0
    first_part_s: float = 2.0
    part_gap_s: float = 1.0
    fetch_s: float = 6.0  # under the runner's own bound (RunnerPrefixShare.fetch_wait_s)
    export_ttl_s: float = 30.0  # an export whose parts stopped coming is forgotten
    limits: IndexLimits = field(default_factory=IndexLimits)

    def __post_init__(self) -> None:
        for name in ("publish_interval_s", "snapshot_interval_s", "first_part_s",
                     "part_gap_s", "fetch_s", "export_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"prefix sharing {name} must be positive")


@dataclass
class _LocalInstance:
    """What one of this node's serving runners holds, and what is not published yet."""

    compat: str
    seq: int = 0
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    anchors: OrderedDict[bytes, bytes] = field(default_factory=OrderedDict)
    sessions: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    pending: list[PrefixReport] = field(default_factory=list)

    def record(self, report: PrefixReport, limits: IndexLimits) -> None:
        self.compat = report.compat
        for block_hash in report.removed:
            self.blocks.pop(block_hash, None)
        for table, items, limit in ((self.blocks, ((h, None) for h in report.stored),
                                     limits.max_blocks),
                                    (self.anchors, report.anchors, limits.max_anchors),
                                    (self.sessions, ((s, None) for s in report.sessions),
                                     limits.max_sessions)):
            for key, value in items:
                table[key] = value
                table.move_to_end(key)
                while len(table) > limit:
                    table.popitem(last=False)
        self.pending.append(report)

    def delta(self, instance_id: str, node_id: NodeId) -> PrefixUpdate | None:
        if not self.pending:
            return None
        reports, self.pending = self.pending, []
        self.seq += 1
        return PrefixUpdate(
            instance_id=instance_id, node_id=node_id, compat=self.compat, seq=self.seq,
            stored=tuple(h for r in reports for h in r.stored),
            removed=tuple(h for r in reports for h in r.removed),
            anchors=tuple(a for r in reports for a in r.anchors),
            sessions=tuple(s for r in reports for s in r.sessions))

    def snapshot(self, instance_id: str, node_id: NodeId) -> PrefixUpdate:
        self.pending = []
        self.seq += 1
        return PrefixUpdate(instance_id=instance_id, node_id=node_id, compat=self.compat,
                            seq=self.seq, snapshot=True, stored=tuple(self.blocks),
                            anchors=tuple(self.anchors.items()),
                            sessions=tuple(self.sessions))


class PrefixShare:
    def __init__(self, transport: Transport, registry: RunnerRegistry,
                 state: Callable[[], ClusterState], config: ShareConfig | None = None) -> None:
        self.config = config or ShareConfig()
        self._transport = transport
        self._registry = registry
        self._state = state
        self.node_id = transport.node_id
        self.index = PrefixIndex(self.config.limits)
        self._local: dict[str, _LocalInstance] = {}
        self._fetches: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._exports: dict[str, tuple[NodeId, float]] = {}  # export id -> (asker, since)
        self._tasks: set[asyncio.Task] = set()
        self._subscriptions: list[Subscription] = []
        self._snapshot_due = 0.0
        self.fetches_completed = 0  # fetches that got every part they asked for

    async def start(self) -> None:
        self._subscriptions = [
            self._transport.subscribe(Topic.PREFIXES, self._on_update),
            self._transport.subscribe_data(self._on_data),
            self._transport.on_peers_changed(lambda _peers: self._snapshot_soon())]
        self._registry.on_prefix = self._on_runner
        self._own(self._publish_loop())

    async def stop(self) -> None:
        self._registry.on_prefix = None
        for subscription in self._subscriptions:
            subscription.close()
        self._subscriptions = []
        await cancel_and_wait(self._tasks)

    def _own(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _snapshot_soon(self) -> None:
        self._snapshot_due = 0.0  # a new peer knows nothing yet

    # ---- publication --------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.publish_interval_s)
            try:
                self.publish()
            except TransportError as error:
                log.warning("cannot publish prefix blocks: %s", error)

    def publish(self, now: float | None = None) -> None:
        """One round: deltas, or snapshots when due; forget what is gone."""
        now = time.monotonic() if now is None else now
        state = self._state()
        for instance_id in [i for i in self._local if i not in state.instances]:
            del self._local[instance_id]
        self.index.retain(state.instances)
        self._exports = {k: v for k, v in self._exports.items()
                         if now - v[1] < self.config.export_ttl_s}
        snapshot = now >= self._snapshot_due
        if snapshot:
            self._snapshot_due = now + self.config.snapshot_interval_s
        for instance_id, local in self._local.items():
            update = local.snapshot(instance_id, self.node_id) if snapshot \
                else local.delta(instance_id, self.node_id)
            if update is not None:
                self._transport.publish(Topic.PREFIXES, update.model_dump(mode="python"))

    def _on_update(self, message: Any) -> None:
        try:
            update = PrefixUpdate.model_validate(message)
        except pydantic.ValidationError as error:
            log.warning("malformed prefix update dropped: %s", error)
            return
        if update.instance_id in self._state().instances:
            self.index.apply(update)

    # ---- this node's runners ----------------------------------------------------------

    def _on_runner(self, key: RunnerKey, message: Any) -> None:
        instance_id, rank = key
        if isinstance(message, PrefixReport) and rank == 0:
            local = self._local.get(instance_id)
            if local is None:
                local = self._local[instance_id] = _LocalInstance(message.compat)
            local.record(message, self.config.limits)
        elif isinstance(message, PrefixWanted):
            self._own(self._fetch(key, message))
        elif isinstance(message, PrefixExportPart):
            self._forward_part(message)

    # ---- fetching (the asking side) ----------------------------------------------------

    async def _fetch(self, key: RunnerKey, wanted: PrefixWanted) -> None:
        outcome = "no other instance holds more of this prefix"
        fetch_id = uuid.uuid4().hex
        try:
            holder = self.index.best_holder(wanted.block_hashes, wanted.compat,
                                            exclude=key[0])
            if holder is None or holder[2] <= wanted.have_blocks:
                return
            holder_id, entry, held = holder
            if entry.node_id != self.node_id and entry.node_id not in self._transport.peers:
                outcome = f"the holder's node {entry.node_id} is not connected"
                return
            parts: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
            self._fetches[fetch_id] = parts
            block_size = len(wanted.token_ids) // max(1, len(wanted.block_hashes))
            self._deliver(entry.node_id, {
                KV_FETCH_FIELD: fetch_id, "asker": self.node_id, "instance": holder_id,
                "compat": wanted.compat, "start_block": wanted.have_blocks,
                "token_ids": list(wanted.token_ids[:held * block_size])})
            outcome = await self._receive(key, wanted.request_id, parts)
        except TransportError as error:
            outcome = f"cannot ask the holder: {error}"
        finally:
            self._fetches.pop(fetch_id, None)
            supervisor = self._registry.get(key)
            if supervisor is not None:
                supervisor.tell(PrefixFetched(request_id=wanted.request_id, outcome=outcome))

    async def _receive(self, key: RunnerKey, request_id: str,
                       parts: asyncio.Queue[dict[str, Any]]) -> str:
        """Pass parts on until the last; the outcome ("complete" or why it stopped)."""
        config = self.config
        deadline = time.monotonic() + config.fetch_s
        expected = 0
        while True:
            wait = config.first_part_s if expected == 0 else config.part_gap_s
            wait = min(wait, deadline - time.monotonic())
            try:
                async with asyncio.timeout(max(0.0, wait)):
                    part = await parts.get()
            except TimeoutError:
                return f"the holder sent no part within {wait:.1f} s after {expected} parts"
            if part.get("error"):
                return f"the holder has none to give: {part['error']}"
            if part.get("seq") != expected or not isinstance(part.get("blocks"), dict):
                return f"part {part.get('seq')} came where {expected} was due"
            supervisor = self._registry.get(key)
            if supervisor is None:
                return "the asking runner is gone"
            supervisor.tell(PrefixPart(request_id=request_id, blocks=part["blocks"]))
            if expected == 0:  # how long the holder took to start answering
                log.info("prefix blocks for %s arriving after %.3f s", request_id,
                         config.fetch_s - (deadline - time.monotonic()))
            expected += 1
            if part.get("last"):
                self.fetches_completed += 1
                return "complete"

    # ---- exporting (the holding side) ---------------------------------------------------

    def _on_data(self, message: Any) -> None:
        if not isinstance(message, dict):
            return
        if KV_PART_FIELD in message:
            parts = self._fetches.get(str(message[KV_PART_FIELD]))
            if parts is not None:
                parts.put_nowait(message)
        elif KV_FETCH_FIELD in message:
            self._export(message)

    def _export(self, message: dict[str, Any]) -> None:
        try:
            export_id, asker = str(message[KV_FETCH_FIELD]), NodeId(str(message["asker"]))
            export = PrefixExport(export_id=export_id, compat=str(message["compat"]),
                                  token_ids=tuple(message["token_ids"]),
                                  start_block=int(message["start_block"]))
            instance_id = str(message["instance"])
        except (KeyError, TypeError, ValueError, pydantic.ValidationError) as error:
            log.warning("malformed prefix fetch dropped: %s", error)
            return
        supervisor = self._registry.get((instance_id, 0))
        if supervisor is None or supervisor.state != "ready":
            self._send_part(asker, {KV_PART_FIELD: export_id, "seq": 0, "last": True,
                                    "error": f"instance {instance_id} is not served here"})
            return
        self._exports[export_id] = (asker, time.monotonic())
        log.info("exporting prefix blocks of %s to node %s", instance_id, asker)
        supervisor.tell(export)

    def _forward_part(self, part: PrefixExportPart) -> None:
        export = self._exports.get(part.export_id)
        if export is None:
            return  # expired
        if part.last:
            del self._exports[part.export_id]
        self._send_part(export[0], {KV_PART_FIELD: part.export_id, "seq": part.seq,
                                    "last": part.last, "blocks": part.blocks,
                                    "error": part.error})

    def _send_part(self, asker: NodeId, message: dict[str, Any]) -> None:
        try:
            self._deliver(asker, message)
        except TransportError as error:
            log.warning("cannot send prefix blocks to %s: %s", asker, error)

    def _deliver(self, node: NodeId, message: dict[str, Any]) -> None:
        """To node's data key; to this node directly (two instances here)."""
        if node == self.node_id:
            asyncio.get_running_loop().call_soon(self._on_data, message)
        else:
            self._transport.send_data(node, message)
