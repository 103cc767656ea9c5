"""Asking every other node a question and gathering their answers, each within a bound.

A question is published on the queries topic as {"query_id", "asker", "kind", "args", "to"};
each node named in "to" runs its handler for kind and sends {"answer_to", "node", "body"}
(or "error" instead of "body") to the asker's data key. The asker waits up to timeout_s
for everyone it asked; a node that does not answer in time, has no handler or fails is
reported with the reason. Answers are msgpack-able values (what the handler returns).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from shoal.cluster.background import cancel_and_wait
from shoal.cluster.transport.base import Subscription, Transport, TransportError
from shoal.cluster.transport.topics import Topic
from shoal.ids import NodeId

log = logging.getLogger("shoal.cluster.queries")

# An answer on the data key carries this field (data_plane skips such messages).
ANSWER_FIELD = "answer_to"
# The most answers being computed for others at once; more questions are refused.
_MAX_ANSWERING = 32

Handler = Callable[[dict[str, Any]], Awaitable[Any]]  # args -> the answer's body


@dataclass(frozen=True)
class NodeAnswer:
    """One node's answer: body, or why there is none (error)."""

    body: Any = None
    error: str | None = None


class ClusterQueries:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._handlers: dict[str, Handler] = {}
        # query id -> (nodes asked, their answers so far, set on each answer)
        self._asked: dict[str, tuple[frozenset[NodeId], dict[NodeId, NodeAnswer],
                                     asyncio.Event]] = {}
        self._answering: set[asyncio.Task] = set()
        self._subscriptions: list[Subscription] = []

    def serve(self, kind: str, handler: Handler) -> None:
        """Answer questions of kind with handler(args) (it bounds its own waits)."""
        self._handlers[kind] = handler

    def start(self) -> None:
        self._subscriptions = [self._transport.subscribe(Topic.QUERIES, self._on_question),
                               self._transport.subscribe_data(self._on_data)]

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            subscription.close()
        self._subscriptions = []
        await cancel_and_wait(self._answering)

    async def ask(self, kind: str, args: dict[str, Any], timeout_s: float,
                  nodes: frozenset[NodeId] | None = None) -> dict[NodeId, NodeAnswer]:
        """Every node's answer (nodes: those asked; default every connected peer), waiting
        at most timeout_s; a node without an answer by then gets NodeAnswer(error=...)."""
        asked = sorted(self._transport.peers if nodes is None else nodes)
        if not asked:
            return {}
        query_id = uuid.uuid4().hex
        answers: dict[NodeId, NodeAnswer] = {}
        changed = asyncio.Event()
        self._asked[query_id] = (frozenset(asked), answers, changed)
        try:
            self._transport.publish(Topic.QUERIES, {
                "query_id": query_id, "asker": self._transport.node_id, "kind": kind,
                "args": args, "to": list(asked)})
            async with asyncio.timeout(timeout_s):
                while len(answers) < len(asked):
                    await changed.wait()
                    changed.clear()
        except TimeoutError:
            pass
        except TransportError as error:
            return {node: NodeAnswer(error=f"could not ask: {error}") for node in asked}
        finally:
            del self._asked[query_id]
        missing = NodeAnswer(error=f"no answer within {timeout_s:g} s")
        return {node: answers.get(node, missing) for node in asked}

    def _on_question(self, message: Any) -> None:
        try:
            query_id, asker = str(message["query_id"]), NodeId(str(message["asker"]))
            kind, args, to = str(message["kind"]), dict(message["args"]), message["to"]
        except (TypeError, KeyError, ValueError) as error:
            log.warning("malformed question dropped: %s", error)
            return
        if self._transport.node_id not in to or asker == self._transport.node_id:
            return
        if len(self._answering) >= _MAX_ANSWERING:
            self._reply(asker, query_id, error="this node is answering too many questions")
            return
        task = asyncio.get_running_loop().create_task(self._answer(asker, query_id, kind, args))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _answer(self, asker: NodeId, query_id: str, kind: str,
                      args: dict[str, Any]) -> None:
        handler = self._handlers.get(kind)
        if handler is None:
            self._reply(asker, query_id, error=f"this node does not answer {kind!r}")
            return
        try:
            body = await handler(args)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - the asker learns why, the node goes on
            log.exception("answering %s for %s failed", kind, asker)
            self._reply(asker, query_id, error=f"{type(error).__name__}: {error}")
            return
        self._reply(asker, query_id, body=body)

    def _reply(self, asker: NodeId, query_id: str, body: Any = None,
               error: str | None = None) -> None:
        answer = {ANSWER_FIELD: query_id, "node": self._transport.node_id}
        answer.update({"error": error} if error is not None else {"body": body})
        try:
            self._transport.send_data(asker, answer)
        except TransportError as failure:
            log.warning("could not answer %s: %s", asker, failure)

    def _on_data(self, message: Any) -> None:
        if not isinstance(message, dict) or ANSWER_FIELD not in message:
            return  # token chunks: the data plane's
        waiting = self._asked.get(str(message[ANSWER_FIELD]))
        node = NodeId(str(message.get("node")))
        if waiting is None or node not in waiting[0]:
            return  # late (the asker stopped waiting), or not asked
        _asked, answers, changed = waiting
        answers[node] = NodeAnswer(body=message.get("body"), error=message.get("error"))
        changed.set()
