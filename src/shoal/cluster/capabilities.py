"""This node's capability card, every node's cards, and the proposer roles built on them.

The card says which models this node's runners serve (role verifier, with the decode
tokens/s they last measured), which target models it guesses for (role proposer, from
--propose-for), and its load (CPU, queue, requests in flight, proposer sessions).
Its runners' asks for guesses go through the relay to the node the cards choose.
"""

from __future__ import annotations

import time
from typing import Any

from shoal.cluster.card_exchange import CardConfig, CardExchange
from shoal.cluster.cards import CapabilityCard, CardLoad, ModelRole
from shoal.cluster.proposal_relay import ProposalRelay
from shoal.cluster.proposer_service import ProposerConfig, ProposerService, TargetTokenizer
from shoal.cluster.telemetry import TelemetryTable
from shoal.cluster.transport.base import Transport
from shoal.pool.pool import ModelPool


class Capabilities:
    def __init__(self, transport: Transport, pool: ModelPool, telemetry: TelemetryTable,
                 cards: CardConfig, proposer: ProposerConfig,
                 target_tokenizer: TargetTokenizer | None = None) -> None:
        """target_tokenizer: a target model's tokenizer copied from a node holding it."""
        self._node_id = transport.node_id
        self._pool = pool
        self._telemetry = telemetry
        # model -> (tokens generated, when counted, last measured tokens/s)
        self._throughput: dict[str, tuple[int, float, float | None]] = {}
        self.proposer = ProposerService(transport, proposer, target_tokenizer=target_tokenizer)
        self.exchange = CardExchange(transport, cards, self._build_card)
        self.relay = ProposalRelay(transport, self.exchange.cards, local=self.proposer)

    async def start(self) -> None:
        self.proposer.start()
        self.relay.start()
        await self.exchange.start()
        self._pool.registry.proposals.relay = self.relay

    async def stop(self) -> None:
        self._pool.registry.proposals.relay = None
        await self.exchange.stop()
        self.relay.stop()
        await self.proposer.stop()

    def describe(self) -> list[dict[str, Any]]:
        """GET /cluster/cards: every live card, by node id."""
        return [card.model_dump(mode="json") for card in self.exchange.cards()]

    def _build_card(self, announced_at: float, ttl_s: float) -> CapabilityCard:
        models = [ModelRole(model=model, role="verifier", tokens_per_s=rate)
                  for model, rate in self._verifiers().items()]
        models += [ModelRole(model=target, role="proposer", source=source)
                   for target, source in self.proposer.offers()]
        reading = self._telemetry.reading(self._node_id)
        supervisors = self._pool.registry.supervisors
        load = CardLoad(cpu_percent=reading.cpu_percent if reading is not None else 0.0,
                        queue_depth=sum(self._pool.queue.depths().values()),
                        in_flight=sum(s.num_in_flight for s in supervisors),
                        proposer_sessions=self.proposer.active_sessions())
        return CapabilityCard(node_id=self._node_id, announced_at=announced_at, ttl_s=ttl_s,
                              models=tuple(models), load=load)

    def _verifiers(self) -> dict[str, float | None]:
        """Model -> decode tokens/s over the last interval it generated anything (None
        until it has), for the text models this node's runners serve whole or lead."""
        now = time.monotonic()
        rates: dict[str, float | None] = {}
        for (_instance, rank), supervisor in self._pool.registry.items():
            info = supervisor.model_info
            if rank != 0 or supervisor.state != "ready" or info is None \
                    or info.task != "generate":
                continue
            model, tokens = supervisor.model_id, supervisor.generated_tokens
            counted, at, rate = self._throughput.get(model, (tokens, now, None))
            if tokens > counted and now > at:
                rate = (tokens - counted) / (now - at)
            self._throughput[model] = (tokens, now, rate)
            rates[model] = rate
        return rates
