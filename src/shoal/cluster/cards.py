"""Capability cards: what each node offers other nodes, gossiped last-writer-wins with a TTL.

A card names a node's models and the role it plays for each (a verifier serving the model,
or a proposer guessing tokens for a target model), the decode tokens/s it measured, and its
load. The registry keeps the newest card per node (by the sender's own `announced_at`, so
clock skew only shifts freshness, and the TTL must be far above any skew); expired cards are
dropped on read and on merge; this node's own card is never replaced by gossip. Merging is
commutative, associative and idempotent, so exchange order and repetition cannot diverge
two nodes' views. Never event-sourced: a silent node's card simply ages out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import pydantic

from shoal.cluster.instances import Frozen
from shoal.ids import NodeId

Role = Literal["verifier", "proposer"]
DEFAULT_TTL_S = 30.0


class ModelRole(Frozen):
    """model: the model served (verifier), or the target model guessed for (proposer);
    source: where a proposer's guesses come from ("ngram", "draft:MODEL")."""

    model: str
    role: Role
    source: str = ""
    tokens_per_s: float | None = None  # measured decode throughput; None: not measured


class CardLoad(Frozen):
    cpu_percent: float = 0.0
    queue_depth: int = 0      # requests waiting for a turn on the node
    in_flight: int = 0        # requests its runners are serving
    proposer_sessions: int = 0  # requests it guesses for other nodes

    @property
    def busy(self) -> int:
        return self.queue_depth + self.in_flight + self.proposer_sessions


class CapabilityCard(Frozen):
    node_id: NodeId
    announced_at: float  # unix seconds on the announcing node's clock
    ttl_s: float = pydantic.Field(default=DEFAULT_TTL_S, gt=0)
    models: tuple[ModelRole, ...] = ()
    load: CardLoad = CardLoad()

    def expired(self, now: float) -> bool:
        return now > self.announced_at + self.ttl_s

    def proposes_for(self, model_id: str) -> ModelRole | None:
        wanted = model_id.lower()
        return next((m for m in self.models
                     if m.role == "proposer" and m.model.lower() == wanted), None)


class CardRegistry:
    """The newest live card per node. `now` is unix seconds (cards carry wall-clock times)."""

    def __init__(self, own: CapabilityCard) -> None:
        self._own = own
        self._cards: dict[NodeId, CapabilityCard] = {own.node_id: own}

    @property
    def node_id(self) -> NodeId:
        return self._own.node_id

    @property
    def own(self) -> CapabilityCard:
        return self._own

    def set_own(self, card: CapabilityCard) -> None:
        if card.node_id != self._own.node_id:
            raise ValueError(f"this node is {self._own.node_id}, not {card.node_id}")
        self._own = self._cards[card.node_id] = card

    def merge(self, cards: Iterable[CapabilityCard], now: float) -> list[NodeId]:
        """Keep each card that is live and newer than what is held; the nodes whose card
        changed. Cards about this node are ignored: its own card is authoritative."""
        changed = []
        for card in cards:
            if card.node_id == self.node_id or card.expired(now):
                continue
            held = self._cards.get(card.node_id)
            if held is None or held.announced_at < card.announced_at:
                self._cards[card.node_id] = card
                changed.append(card.node_id)
        self._drop_expired(now)
        return changed

    def snapshot(self, now: float) -> dict[NodeId, CapabilityCard]:
        """Every live card (this node's always), dropping the expired ones."""
        self._drop_expired(now)
        return dict(self._cards)

    def _drop_expired(self, now: float) -> None:
        for node, card in list(self._cards.items()):
            if node != self.node_id and card.expired(now):
                del self._cards[node]


def cards_to_wire(cards: Iterable[CapabilityCard]) -> list[dict[str, Any]]:
    return [card.model_dump(mode="json") for card in cards]


def cards_from_wire(raw: Any) -> list[CapabilityCard]:
    """The valid cards of a message's list (a malformed card is skipped, not fatal)."""
    cards = []
    for item in raw if isinstance(raw, list) else ():
        try:
            cards.append(CapabilityCard.model_validate(item))
        except pydantic.ValidationError:
            continue
    return cards


def choose_proposer(cards: Sequence[CapabilityCard], target: str, verifier: NodeId,
                    avoid: frozenset[NodeId] = frozenset()) -> NodeId | None:
    """The node to ask for guesses for `target`, the same on every node for the same
    cards: a node other than the verifier when one offers it, then the most idle (fewest
    requests and sessions, then lowest CPU in 10% steps), then the smallest id."""
    offering = [c for c in cards if c.proposes_for(target) is not None
                and c.node_id not in avoid]
    if not offering:
        return None
    best = min(offering, key=lambda c: (c.node_id == verifier, c.load.busy,
                                        int(c.load.cpu_percent // 10), c.node_id))
    return best.node_id
