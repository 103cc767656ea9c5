"""Spreading capability cards by push-pull exchange between peers.

A node sends every live card it holds (its own included) to a peer's data key as
{"cards": [...], "from": node, "reply": true}; the peer merges them and answers with its
merged view (reply false), which the first node merges in turn: after one round both hold
the union. A node exchanges with each peer that joins at once, and with every peer each
interval (refreshing its own card first), so a joining node learns every card within one
round trip and a silent node's card, no longer refreshed, expires after its TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shoal.cluster.background import cancel_and_wait
from shoal.cluster.cards import (
    DEFAULT_TTL_S,
    CapabilityCard,
    CardRegistry,
    cards_from_wire,
    cards_to_wire,
)
from shoal.cluster.transport.base import Subscription, Transport, TransportError
from shoal.ids import NodeId

log = logging.getLogger("shoal.cluster.cards")

# A card exchange on the data key carries this field (data_plane skips such messages).
CARDS_FIELD = "cards"


@dataclass(frozen=True)
class CardConfig:
    interval_s: float = 5.0
    ttl_s: float = DEFAULT_TTL_S

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError("the card exchange interval must be positive")
        if self.ttl_s <= 2 * self.interval_s:
            raise ValueError(f"a card's TTL must exceed two exchange intervals "
                             f"({2 * self.interval_s:g} s)")


# (announced_at, ttl_s) -> this node's card now
BuildCard = Callable[[float, float], CapabilityCard]


class CardExchange:
    def __init__(self, transport: Transport, config: CardConfig, build: BuildCard) -> None:
        self._transport = transport
        self.config = config
        self._build = build
        self.registry = CardRegistry(build(time.time(), config.ttl_s))
        self._known_peers: frozenset[NodeId] = frozenset()
        self._subscriptions: list[Subscription] = []
        self._task: asyncio.Task[None] | None = None

    def cards(self) -> list[CapabilityCard]:
        """Every live card, by node id."""
        snapshot = self.registry.snapshot(time.time())
        return [snapshot[node] for node in sorted(snapshot)]

    async def start(self) -> None:
        self._subscriptions = [self._transport.subscribe_data(self._on_data),
                               self._transport.on_peers_changed(self._on_peers)]
        self._task = asyncio.create_task(self._run(), name="card-exchange")

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            subscription.close()
        self._subscriptions = []
        await cancel_and_wait([self._task])
        self._task = None

    def refresh(self) -> None:
        """Announce this node's card anew (its load and models as they are now)."""
        try:
            self.registry.set_own(self._build(time.time(), self.config.ttl_s))
        except Exception:  # noqa: BLE001 - a failed reading keeps the previous card
            log.exception("cannot build this node's capability card")

    async def _run(self) -> None:
        while True:
            self.refresh()
            for peer in sorted(self._transport.peers):
                self._send(peer, reply=True)
            await asyncio.sleep(self.config.interval_s)

    def _on_peers(self, peers: frozenset[NodeId]) -> None:
        joined, self._known_peers = peers - self._known_peers, peers
        for peer in sorted(joined):
            self._send(peer, reply=True)

    def _send(self, peer: NodeId, reply: bool) -> None:
        snapshot = self.registry.snapshot(time.time())
        try:
            self._transport.send_data(peer, {CARDS_FIELD: cards_to_wire(snapshot.values()),
                                             "from": self._transport.node_id,
                                             "reply": reply})
        except TransportError as error:
            log.warning("cannot send capability cards to %s: %s", peer, error)

    def _on_data(self, message: Any) -> None:
        if not isinstance(message, dict) or CARDS_FIELD not in message:
            return  # token chunks, answers, proposals: not ours
        self.registry.merge(cards_from_wire(message[CARDS_FIELD]), time.time())
        sender = message.get("from")
        if message.get("reply") is True and isinstance(sender, str) \
                and sender != self._transport.node_id:
            self._send(NodeId(sender), reply=False)
