"""Guessing tokens for other nodes' verifiers: the proposer role a node offers in its card.

A verifier's node sends {"proposal": "ask", "call", "from", "target", "request_id", "cut",
"tokens", "k"} to this node's data key: keep the first `cut` tokens of the session
(from, request_id), append `tokens`, and answer with up to k guessed tokens and their
probabilities. Cutting then appending is idempotent, so a verifier that lost an answer
simply sends again from what it knows was received. A session this node lacks (restarted,
expired) with cut > 0 is answered "resync": the verifier sends the whole context next time.
Sessions idle for `session_idle_s` are dropped.

Where guesses come from is pluggable per target model: SOURCES maps a source kind (the
text before any ":", as in "draft:MODEL") to a factory of Proposer objects
(engine/speculation/proposer.py); "ngram" is built in. A source marked `blocking = True`
(a draft model) runs on one worker thread, off the event loop; sessions are kept on the
loop either way. Before a draft model's first guess its tokenizer is checked against the
target's: the target's files where this node has them, else only its tokenizer copied from
a node that holds the model (target_tokenizer: a GGUF's header, a checkpoint's tokenizer
files); a draft whose tokenizer differs answers "none" (its guesses would be other words).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.catalog.resolve import ModelNotFound, resolve_model
from shoal.engine.config import ModelSource
from shoal.cluster.transport.base import Subscription, Transport, TransportError
from shoal.engine.speculation.config import MAX_NUM_DRAFTS
from shoal.engine.speculation.ngram import NgramProposer
from shoal.engine.speculation.proposer import Proposal, Proposer
from shoal.ids import NodeId

log = logging.getLogger("shoal.cluster.proposals")

# Proposal messages on the data key carry this field: "ask", "answer" or "forget"
# (data_plane skips such messages).
PROPOSAL_FIELD = "proposal"

# source kind -> factory(target model, source as given, data dir) of the Proposer guessing
# for it
SourceFactory = Callable[[str, str, "Path | None"], Proposer]


def _draft_source(target: str, source: str, data_dir: Path | None) -> Proposer:
    from shoal.engine.speculation.draft import DraftSource  # torch: only where it guesses

    return DraftSource(source.partition(":")[2],
                       functools.partial(resolve_model, data_dir=data_dir))


SOURCES: dict[str, SourceFactory] = {"ngram": lambda target, source, data_dir: NgramProposer(),
                                     "draft": _draft_source}


@dataclass(frozen=True)
class ProposerConfig:
    # target model -> source ("ngram"), from --propose-for TARGET[=SOURCE]
    offers: Mapping[str, str] = field(default_factory=dict)
    data_dir: Path | None = None  # where a draft model's files are found or joined
    session_idle_s: float = 60.0
    max_sessions: int = 4096

    def __post_init__(self) -> None:
        for target, source in self.offers.items():
            if _kind(source) not in SOURCES:
                raise ValueError(f"--propose-for {target}={source}: the proposal source must "
                                 f"be one of {', '.join(sorted(SOURCES))}")
        if self.session_idle_s <= 0 or self.max_sessions < 1:
            raise ValueError("proposer sessions need a positive idle time and count")


@dataclass
class _Session:
    target: str
    tokens: list[int]
    used_at: float


# A target model's tokenizer from a node that holds it (None when none does).
TargetTokenizer = Callable[[str], Awaitable[ModelSource | None]]


class ProposerService:
    def __init__(self, transport: Transport, config: ProposerConfig,
                 clock: Callable[[], float] = time.monotonic,
                 target_tokenizer: TargetTokenizer | None = None) -> None:
        self._transport = transport
        self.config = config
        self._clock = clock
        self._target_tokenizer = target_tokenizer
        # target -> why its draft cannot guess for it (None: it can), checked once.
        self._tokenizer_checks: dict[str, asyncio.Task[str | None]] = {}
        self._sources = {target.lower(): SOURCES[_kind(source)](target, source, config.data_dir)
                         for target, source in config.offers.items()}
        self._sessions: dict[tuple[NodeId, str], _Session] = {}
        self._subscription: Subscription | None = None
        self._working: set[asyncio.Task] = set()
        # Blocking sources run here, one call at a time (a draft model is not reentrant).
        self._worker: ThreadPoolExecutor | None = None
        if any(getattr(source, "blocking", False) for source in self._sources.values()):
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="proposer")
        self.answered = 0  # asks answered with guesses (for tests and the card)

    def offers(self) -> list[tuple[str, str]]:
        """(target model, source name) this node guesses for."""
        return sorted(self.config.offers.items())

    def start(self) -> None:
        self._subscription = self._transport.subscribe_data(self._on_data)

    async def stop(self) -> None:
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None
        for task in list(self._working):
            task.cancel()
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)

    def active_sessions(self) -> int:
        self._expire(self._clock())
        return len(self._sessions)

    def answer(self, ask: Mapping[str, Any]) -> dict[str, Any]:
        """The answer to one ask (ValueError for a malformed one), guessed on this thread."""
        prepared = self._prepare(ask)
        if isinstance(prepared, dict):
            return prepared
        source, key, context, k = prepared
        return self._reply_with(ask, source.propose(key, context, k), k)

    def _prepare(self, ask: Mapping[str, Any]
                 ) -> dict[str, Any] | tuple[Proposer, str, list[int], int]:
        """Bring the ask's session up to date: an answer at once ("none", "resync"), or
        what to ask the source (source, session key, the session's tokens, k)."""
        sender, request_id = NodeId(str(ask["from"])), str(ask["request_id"])
        target, cut, k = str(ask["target"]).lower(), int(ask["cut"]), int(ask["k"])
        tokens = [int(t) for t in ask["tokens"]]
        if cut < 0 or not 0 <= k <= MAX_NUM_DRAFTS:
            raise ValueError(f"cut {cut} or k {k} out of range")
        source = self._sources.get(target)
        if source is None:
            return _reply(ask, "none")
        now = self._clock()
        self._expire(now)
        key = (sender, request_id)
        session = self._sessions.get(key)
        if session is None and len(self._sessions) >= self.config.max_sessions:
            return _reply(ask, "none")
        if session is None or session.target != target:
            session = self._sessions[key] = _Session(target, [], now)
        if cut > len(session.tokens):  # it lacks what the verifier thinks it holds
            self.forget(sender, request_id)
            return _reply(ask, "resync")
        del session.tokens[cut:]
        session.tokens.extend(tokens)
        session.used_at = now
        return source, _source_key(key), session.tokens, k

    def _reply_with(self, ask: Mapping[str, Any], proposal: Proposal | None,
                    k: int) -> dict[str, Any]:
        proposal = proposal or Proposal([], [])
        self.answered += 1
        return _reply(ask, "ok", proposal.tokens[:k], proposal.probs[:k])

    def forget(self, sender: NodeId, request_id: str) -> None:
        session = self._sessions.pop((sender, request_id), None)
        if session is None:
            return
        source, key = self._sources[session.target], _source_key((sender, request_id))
        if self._worker is not None and getattr(source, "blocking", False):
            self._worker.submit(source.forget, key)  # after any call of it in progress
        else:
            source.forget(key)

    def _expire(self, now: float) -> None:
        idle = [key for key, s in self._sessions.items()
                if now - s.used_at > self.config.session_idle_s]
        for key in idle:
            self.forget(*key)

    async def answer_here(self, ask: Mapping[str, Any]) -> dict[str, Any]:
        """The answer to an ask from this node itself (ValueError for a malformed one);
        a blocking source guesses on the worker thread."""
        prepared = self._prepare(ask)
        if isinstance(prepared, dict):
            return prepared
        source, key, context, k = prepared
        if self._worker is not None and getattr(source, "blocking", False):
            if await self._tokenizer_problem(str(ask["target"]).lower(), source) is not None:
                return _reply(ask, "none")
            # A copy: the session may grow on the loop while the worker reads it.
            proposal = await asyncio.get_running_loop().run_in_executor(
                self._worker, source.propose, key, list(context), k)
        else:
            proposal = source.propose(key, context, k)
        return self._reply_with(ask, proposal, k)

    async def _tokenizer_problem(self, target: str, source: Proposer) -> str | None:
        """Why source (a draft model) cannot guess for target, or None; checked once."""
        check = self._tokenizer_checks.get(target)
        if check is None:
            check = asyncio.get_running_loop().create_task(self._check_tokenizer(target,
                                                                                 source))
            self._tokenizer_checks[target] = check
        return await asyncio.shield(check)

    async def _check_tokenizer(self, target: str, source: Proposer) -> str | None:
        files = getattr(source, "files", None)
        if files is None:
            return None
        try:
            target_files = await asyncio.to_thread(resolve_model, target,
                                                   data_dir=self.config.data_dir)
        except ModelNotFound:
            target_files = None
        try:
            if target_files is None and self._target_tokenizer is not None:
                target_files = await self._target_tokenizer(target)
        except ModelNotFound as error:
            log.warning("cannot copy the tokenizer of %s from a peer: %s", target, error)
        if target_files is None:
            log.info("no tokenizer of %s to check the draft model %s against; guessing "
                     "unchecked (the verifier keeps its output exact)", target, files)
            return None
        from shoal.engine.speculation.draft import DraftMismatch, check_draft_pair

        try:
            draft_files = await asyncio.to_thread(files)
            await asyncio.get_running_loop().run_in_executor(
                self._worker, check_draft_pair, target_files, draft_files)
        except DraftMismatch as error:
            log.error("%s; this node answers no guesses for %s", error, target)
            return str(error)
        return None

    def _on_data(self, message: Any) -> None:
        if not isinstance(message, dict):
            return
        kind = message.get(PROPOSAL_FIELD)
        if kind == "forget":
            self.forget(NodeId(str(message.get("from"))), str(message.get("request_id")))
        elif kind == "ask":
            task = asyncio.get_running_loop().create_task(self._answer_ask(message))
            self._working.add(task)
            task.add_done_callback(self._working.discard)

    async def _answer_ask(self, ask: dict[str, Any]) -> None:
        try:
            answer = await self.answer_here(ask)
        except (KeyError, TypeError, ValueError) as error:
            log.warning("malformed proposal ask dropped: %s", error)
            return
        self._send_answer(ask, answer)

    def _send_answer(self, ask: dict[str, Any], answer: dict[str, Any]) -> None:
        try:
            self._transport.send_data(NodeId(str(ask["from"])), answer)
        except (TransportError, ValueError) as error:
            log.warning("cannot answer a proposal ask: %s", error)


def _kind(source: str) -> str:
    return source.partition(":")[0]


def _source_key(key: tuple[NodeId, str]) -> str:
    return f"{key[0]}/{key[1]}"


def _reply(ask: Mapping[str, Any], outcome: str, tokens: list[int] | None = None,
           probs: list[float] | None = None) -> dict[str, Any]:
    return {PROPOSAL_FIELD: "answer", "call": ask.get("call"), "outcome": outcome,
            "tokens": list(tokens or ()), "probs": [float(p) for p in probs or ()]}
