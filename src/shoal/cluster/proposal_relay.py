"""A verifier's node asking proposer nodes for guesses on behalf of its runners.

Each ask goes to the node the cards choose (cards.choose_proposer: deterministic, idle
first, another node preferred), and a request stays with the node it started on, so that
node keeps its context and only new tokens travel. Every wait is bounded by the ask's own
deadline; a node that misses one is avoided for a while (twice as long after each miss,
up to MAX_AVOID_S), and a request moved to another node answers "resync" so its runner
sends the whole context. Answers: {"outcome": "ok" | "resync" | "none", "tokens", "probs"}.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from shoal.cluster.cards import CapabilityCard, choose_proposer
from shoal.cluster.proposer_service import PROPOSAL_FIELD, ProposerService
from shoal.cluster.transport.base import Subscription, Transport, TransportError
from shoal.ids import NodeId

log = logging.getLogger("shoal.cluster.proposals")

FIRST_AVOID_S = 0.1
MAX_AVOID_S = 30.0
# Requests whose runner never said they ended (it crashed) are forgotten past this many.
MAX_ASSIGNED = 10_000
NONE: dict[str, Any] = {"outcome": "none", "tokens": [], "probs": []}


class ProposalRelay:
    """cards: the live capability cards now; local: this node's own proposer service
    (asked directly, not over the transport), if it has one."""

    def __init__(self, transport: Transport, cards: Callable[[], Sequence[CapabilityCard]],
                 local: ProposerService | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._transport = transport
        self._cards = cards
        self._local = local
        self._clock = clock
        self._calls = itertools.count()
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._assigned: dict[tuple[str, str], NodeId] = {}  # (model, request) -> node
        self._misses: dict[NodeId, tuple[int, float]] = {}  # node -> (misses, avoid until)
        self._subscription: Subscription | None = None

    def start(self) -> None:
        self._subscription = self._transport.subscribe_data(self._on_data)

    def stop(self) -> None:
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None
        for future in self._waiting.values():
            if not future.done():
                future.set_result(NONE)

    def proposer_for(self, model_id: str, request_id: str) -> NodeId | None:
        """The node this request's guesses come from: the one it has, while that one is
        still offered and not being avoided; else the cards' choice now."""
        now = self._clock()
        avoid = frozenset(n for n, (_, until) in self._misses.items() if until > now)
        present = self._transport.peers | {self._transport.node_id}
        cards = [c for c in self._cards() if c.node_id in present]
        key = (model_id.lower(), request_id)
        held = self._assigned.get(key)
        if held is not None and held not in avoid and any(
                c.node_id == held and c.proposes_for(model_id) for c in cards):
            return held
        chosen = choose_proposer(cards, model_id, self._transport.node_id, avoid)
        if chosen is None:
            self._assigned.pop(key, None)
        else:
            self._assigned[key] = chosen
            if len(self._assigned) > MAX_ASSIGNED:
                del self._assigned[next(iter(self._assigned))]  # the oldest
        return chosen

    async def ask(self, model_id: str, request_id: str, cut: int, tokens: Sequence[int],
                  k: int, timeout_s: float) -> dict[str, Any]:
        held = self._assigned.get((model_id.lower(), request_id))
        node = self.proposer_for(model_id, request_id)
        if node is None:
            return NONE
        if node != held and cut > 0:  # the new node has none of this request's context
            return {"outcome": "resync", "tokens": [], "probs": []}
        ask = {PROPOSAL_FIELD: "ask", "from": self._transport.node_id, "target": model_id,
               "request_id": request_id, "cut": cut, "tokens": list(tokens), "k": k}
        if node == self._transport.node_id and self._local is not None:
            try:
                async with asyncio.timeout(timeout_s):
                    return await self._local.answer_here(ask)
            except (TimeoutError, KeyError, TypeError, ValueError):
                return NONE
        call = ask["call"] = next(self._calls)
        future = self._waiting[call] = asyncio.get_running_loop().create_future()
        try:
            self._transport.send_data(node, ask)
            async with asyncio.timeout(timeout_s):
                answer = await future
        except (TimeoutError, TransportError):
            self._missed(node)
            return NONE
        finally:
            self._waiting.pop(call, None)
        self._misses.pop(node, None)
        return answer

    def forget(self, model_id: str, request_id: str) -> None:
        node = self._assigned.pop((model_id.lower(), request_id), None)
        if node is None:
            return
        if node == self._transport.node_id and self._local is not None:
            self._local.forget(node, request_id)
            return
        try:
            self._transport.send_data(node, {PROPOSAL_FIELD: "forget", "request_id": request_id,
                                             "from": self._transport.node_id})
        except TransportError:
            pass  # its session expires on its own

    def _missed(self, node: NodeId) -> None:
        misses = self._misses.get(node, (0, 0.0))[0] + 1
        avoid_s = min(MAX_AVOID_S, FIRST_AVOID_S * 2 ** (misses - 1))
        self._misses[node] = (misses, self._clock() + avoid_s)
        log.info("proposer %s missed a deadline (%d in a row); avoided for %.1f s",
                 node, misses, avoid_s)

    def _on_data(self, message: Any) -> None:
        if not isinstance(message, dict) or message.get(PROPOSAL_FIELD) != "answer":
            return
        call = message.get("call")
        future = self._waiting.get(call) if isinstance(call, int) else None
        if future is not None and not future.done():
            future.set_result(message)
