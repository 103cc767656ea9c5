"""Guesses from another node, for a runner whose model speculates `remote`.

The runner's engine asks within its step (engine/speculation/remote.py); the ask travels
as a Propose frame to the supervisor in the node process, which hands it to the cluster's
proposal relay (cluster/proposal_relay.py) and writes the answer back as Proposed. The
socket's reader thread delivers that answer to the waiting step, so the runner's loop
never sees it. The node process owns the cluster transport (and its TLS): the runner
opens no connection of its own.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import ValidationError

from shoal.engine.core import EngineCore
from shoal.engine.speculation.remote import LinkAnswer, RemoteProposer
from shoal.runner.channel import Channel
from shoal.runner.messages import ForgetProposals, Propose, Proposed

log = logging.getLogger("shoal.runner")


class ChannelProposalLink:
    """The runner's end: ask() sends Propose and waits (bounded) for its Proposed."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._calls = itertools.count()
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[threading.Event, list[Proposed]]] = {}
        channel.intercept("proposed", self._deliver)

    def ask(self, request_id: str, cut: int, tokens: list[int], k: int,
            timeout_s: float) -> LinkAnswer | None:
        call_id = next(self._calls)
        arrived, answer = threading.Event(), []
        with self._lock:
            self._waiting[call_id] = (arrived, answer)
        try:
            self._channel.send(Propose(call_id=call_id, request_id=request_id, cut=cut,
                                       tokens=tuple(tokens), k=k, timeout_s=timeout_s))
            if not arrived.wait(timeout_s) or not answer:
                return None
        finally:
            with self._lock:
                self._waiting.pop(call_id, None)
        reply = answer[0]
        return LinkAnswer(reply.outcome, reply.tokens, reply.probs)

    def forget(self, request_id: str) -> None:
        self._channel.send(ForgetProposals(request_id=request_id))

    def _deliver(self, raw: dict[str, Any]) -> None:
        try:
            reply = Proposed.model_validate(raw)
        except ValidationError as error:
            log.warning("malformed proposal answer dropped: %s", error)
            return
        with self._lock:
            waiting = self._waiting.get(reply.call_id)
        if waiting is not None:  # else: late, the step went on without it
            waiting[1].append(reply)
            waiting[0].set()


def attach_remote_proposer(engine: EngineCore, channel: Channel) -> None:
    """Give the engine's speculator its way to a proposer node, when its model speculates
    `remote` (other engines are left as they are)."""
    speculator = engine.speculator
    if speculator is None:
        return
    if speculator.config is not None and speculator.config.method == "remote":
        speculator.proposer = RemoteProposer(
            ChannelProposalLink(channel), engine.vocab_size,
            step_s=speculator.proposer_costs.plain_seconds)


class ProposalRelay(Protocol):
    """The node's way to proposer nodes (cluster/proposal_relay.py)."""

    async def ask(self, model_id: str, request_id: str, cut: int, tokens: Sequence[int],
                  k: int, timeout_s: float) -> dict[str, Any]: ...

    def forget(self, model_id: str, request_id: str) -> None: ...


class ProposalHook:
    """Where every supervisor of a node sends its runner's asks: the cluster's relay once
    the node has joined its cluster (until then, and without one, the answer is "none")."""

    def __init__(self) -> None:
        self.relay: ProposalRelay | None = None

    async def ask(self, model_id: str, ask: Propose) -> Proposed:
        none = Proposed(call_id=ask.call_id, outcome="none")
        if self.relay is None:
            return none
        try:
            answer = await self.relay.ask(model_id, ask.request_id, ask.cut, ask.tokens,
                                          ask.k, ask.timeout_s)
            return Proposed(call_id=ask.call_id, outcome=answer.get("outcome", "none"),
                            tokens=tuple(answer.get("tokens", ())),
                            probs=tuple(answer.get("probs", ())))
        except (ValidationError, TypeError, AttributeError) as error:
            log.warning("malformed proposal from the cluster dropped: %s", error)
        except Exception:  # noqa: BLE001 - the runner gets its answer whatever happens
            log.exception("relaying a proposal ask failed")
        return none

    def forget(self, model_id: str, request_id: str) -> None:
        if self.relay is not None:
            self.relay.forget(model_id, request_id)
