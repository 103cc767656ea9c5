"""The node's admission queue: every generation and embedding request passes it.

Waiting requests are ordered by (priority, warm bump, arrival): 0 is the most urgent
priority; among equals a request for a model that is loaded goes before one that needs a
load. A request is admitted when its model has a free slot on this node (`parallel`
requests at once) and its client's tier allows one more running request; blocked requests
are skipped, so one busy model never holds up another's. Requests wake when a slot frees,
never by polling. Beyond `max_queue` waiting requests, or a client tier's `max_queued`, or
after `timeout_s` in the queue, a request is refused with Overloaded (the dialect's 429,
Ollama's 503, Anthropic's 529).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shoal.pool.clients import ClientTiers, Tier

DEFAULT_MAX_QUEUE = 512
DEFAULT_QUEUE_TIMEOUT_S = 300.0
DEFAULT_PARALLEL = 32  # the engine's batch (max_num_seqs): more would only wait in it
# Retry-After never says less or more than this.
_RETRY_AFTER_RANGE_S = (1, 60)


@dataclass(frozen=True)
class QueueLimits:
    max_queue: int | None = DEFAULT_MAX_QUEUE  # waiting requests per node; None: no limit
    timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S  # the longest wait for a turn
    parallel: int = DEFAULT_PARALLEL  # requests one model serves at once on this node

    def __post_init__(self) -> None:
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max queue must be >= 0, not {self.max_queue}")
        if not self.timeout_s > 0:
            raise ValueError(f"queue timeout must be positive, not {self.timeout_s}")
        if self.parallel < 1:
            raise ValueError(f"parallel must be >= 1, not {self.parallel}")


class Overloaded(RuntimeError):
    """The request cannot wait its turn: which limit, and when to retry."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Ticket:
    """One request's place in the queue, and then its slot."""

    model: str
    priority: int
    warm: bool  # its model was loaded when it arrived
    client: str | None
    tier: Tier | None
    seq: int
    arrived: float
    admitted_at: float | None = None  # while it holds a slot
    waited_s: float = 0.0  # time in the queue before its turn
    # The most requests of its model running at once, below the queue's parallel (an
    # image pipeline draws one request at a time); None: parallel alone.
    slots: int | None = None
    future: asyncio.Future[None] | None = field(default=None, repr=False)

    @property
    def order(self) -> tuple[int, int, int]:
        return (self.priority, 0 if self.warm else 1, self.seq)



def admissible(waiting: Sequence[Ticket], running_by_model: Counter[str],
               running_by_client: Counter[str | None], parallel: int) -> list[Ticket]:
    """The waiting tickets to admit now, in queue order: each whose model has a slot left
    and whose client's tier has room, counting the ones admitted before it."""
    models, clients = Counter(running_by_model), Counter(running_by_client)
    chosen = []
    for ticket in sorted(waiting, key=lambda t: t.order):
        if models[ticket.model] >= min(parallel, ticket.slots or parallel):
            continue
        cap = ticket.tier.max_concurrent if ticket.tier is not None else None
        if cap is not None and clients[ticket.client] >= cap:
            continue
        models[ticket.model] += 1
        clients[ticket.client] += 1
        chosen.append(ticket)
    return chosen


class AdmissionQueue:
    def __init__(self, limits: QueueLimits | None = None, tiers: ClientTiers | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or QueueLimits()
        self.tiers = tiers
        self._clock = clock
        self._seq = itertools.count()
        self._waiting: list[Ticket] = []
        self._running_models: Counter[str] = Counter()
        self._running_clients: Counter[str | None] = Counter()
        self._served_s = 1.0  # moving average of how long a slot is held (Retry-After)

    # ---- views ----------------------------------------------------------------------------

    def depth(self, model: str | None = None) -> int:
        """Requests waiting for a turn (for one model, or all)."""
        return sum(1 for t in self._waiting if model is None or t.model == model)

    def depths(self) -> dict[str, int]:
        """Model -> requests waiting for it."""
        return dict(Counter(t.model for t in self._waiting))

    def running(self, model: str | None = None) -> int:
        if model is None:
            return sum(self._running_models.values())
        return self._running_models[model]

    def running_models(self) -> set[str]:
        """Models with requests holding a turn now."""
        return {m for m, n in self._running_models.items() if n}

    def busy_models(self) -> set[str]:
        """Models with requests admitted or waiting: not to be evicted."""
        return {m for m, n in self._running_models.items() if n} | {
            t.model for t in self._waiting}

    # ---- admission ------------------------------------------------------------------------

    async def admit(self, model: str, priority: int, client: str | None,
                    warm: bool, slots: int | None = None) -> Ticket:
        """Wait for the request's turn and take a slot (release() gives it back); slots:
        the most requests of the model running at once, if fewer than parallel.
        Overloaded when the queue is full or the wait runs past the queue timeout."""
        tier = self.tiers.tier_of(client) if self.tiers is not None else None
        self._refuse_if_full(client, tier)
        ticket = Ticket(model=model, priority=tier.clamp(priority) if tier else priority,
                        warm=warm, client=client, tier=tier, seq=next(self._seq),
                        arrived=self._clock(), slots=slots,
                        future=asyncio.get_running_loop().create_future())
        self._waiting.append(ticket)
        self._pump()
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                await asyncio.shield(ticket.future)
        except TimeoutError:
            if ticket.admitted_at is not None:
                return ticket
            self._waiting.remove(ticket)
            raise Overloaded(
                f"the request waited {self.limits.timeout_s:.0f} s in this node's queue "
                f"without a turn (--queue-timeout); {self.depth()} request(s) are waiting "
                f"and {self.running()} running", self.retry_after_s()) from None
        except asyncio.CancelledError:
            if ticket.admitted_at is not None:
                self.release(ticket)
            else:
                self._waiting.remove(ticket)
            raise
        return ticket

    def release(self, ticket: Ticket) -> None:
        """The request is done with its slot: the next in line gets it."""
        if ticket.admitted_at is None:
            return
        held = self._clock() - ticket.admitted_at
        self._served_s = 0.8 * self._served_s + 0.2 * held
        self._running_models[ticket.model] -= 1
        self._running_clients[ticket.client] -= 1
        ticket.admitted_at = None
        self._pump()

    def retry_after_s(self) -> int:
        """A guess at when a slot frees: the queue's share of the average time a slot is
        held, within 1 s .. 60 s."""
        low, high = _RETRY_AFTER_RANGE_S
        turns = (self.depth() + 1) / max(1, self.limits.parallel)
        return int(min(high, max(low, math.ceil(self._served_s * turns))))

    def _refuse_if_full(self, client: str | None, tier: Tier | None) -> None:
        limit = self.limits.max_queue
        if limit is not None and len(self._waiting) >= limit:
            raise Overloaded(f"this node's queue is full: {len(self._waiting)} request(s) "
                             f"waiting (--max-queue {limit})", self.retry_after_s())
        if tier is not None and tier.max_queued is not None:
            mine = sum(1 for t in self._waiting if t.client == client)
            if mine >= tier.max_queued:
                raise Overloaded(f"client {client!r} has {mine} request(s) waiting, the most "
                                 f"its tier {tier.name!r} allows (max_queued)",
                                 self.retry_after_s())

    def _pump(self) -> None:
        now = self._clock()
        for ticket in admissible(self._waiting, self._running_models, self._running_clients,
                                 self.limits.parallel):
            self._waiting.remove(ticket)
            self._running_models[ticket.model] += 1
            self._running_clients[ticket.client] += 1
            ticket.admitted_at = now
            ticket.waited_s = now - ticket.arrived
            if ticket.future is not None and not ticket.future.done():
                ticket.future.set_result(None)
