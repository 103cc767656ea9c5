"""The admission queue: order (priority, warm bump, arrival), slots per model, client tiers,
the queue limit and timeout (asyncio, no models)."""

from __future__ import annotations

import asyncio
import functools
from collections import Counter

import pytest

from shoal.pool.clients import ClientTiers, Tier
from shoal.pool.queue import AdmissionQueue, Overloaded, QueueLimits, Ticket, admissible


def synchronous(test):
    """Run an async test body in its own event loop."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))
    return run


def ticket(model: str, priority: int = 5, warm: bool = True, seq: int = 0,
           client: str | None = None, tier: Tier | None = None) -> Ticket:
    return Ticket(model=model, priority=priority, warm=warm, client=client, tier=tier, seq=seq,
                  arrived=0.0)


def test_admissible_takes_priority_then_warm_then_arrival():
    waiting = [ticket("m", 5, seq=0), ticket("m", 1, seq=1), ticket("m", 5, warm=False, seq=2),
               ticket("m", 1, warm=False, seq=3), ticket("m", 5, seq=4)]
    order = admissible(waiting, Counter(), Counter(), parallel=5)
    assert [t.seq for t in order] == [1, 3, 0, 4, 2]


def test_admissible_skips_a_busy_model_without_blocking_another():
    waiting = [ticket("busy", 0, seq=0), ticket("free", 9, seq=1)]
    chosen = admissible(waiting, Counter({"busy": 2}), Counter(), parallel=2)
    assert [t.model for t in chosen] == ["free"]


def test_admissible_holds_a_client_to_its_tier_concurrency():
    tier = Tier(name="free", max_concurrent=1)
    waiting = [ticket("m", seq=i, client="bob", tier=tier) for i in range(3)]
    assert [t.seq for t in admissible(waiting, Counter(), Counter(), parallel=8)] == [0]
    assert admissible(waiting, Counter(), Counter({"bob": 1}), parallel=8) == []


async def _occupy(queue: AdmissionQueue, model: str = "m") -> Ticket:
    return await queue.admit(model, 5, None, warm=True)


@synchronous
async def test_waiting_requests_get_their_turn_in_priority_order():
    queue = AdmissionQueue(QueueLimits(parallel=1))
    busy = await _occupy(queue)
    served: list[int] = []

    async def request(priority: int) -> None:
        held = await queue.admit("m", priority, None, warm=True)
        served.append(priority)
        queue.release(held)

    waiters = [asyncio.create_task(request(p)) for p in (7, 3, 9, 0, 5, 3)]
    await asyncio.sleep(0.01)
    assert queue.depth() == 6 and served == []
    queue.release(busy)
    await asyncio.gather(*waiters)
    assert served == [0, 3, 3, 5, 7, 9]


@synchronous
async def test_a_full_queue_refuses_with_retry_after():
    queue = AdmissionQueue(QueueLimits(parallel=1, max_queue=1))
    await _occupy(queue)
    waiting = asyncio.create_task(queue.admit("m", 5, None, warm=True))
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded) as refused:
        await queue.admit("m", 5, None, warm=True)
    assert "--max-queue 1" in str(refused.value)
    assert 1 <= refused.value.retry_after_s <= 60
    waiting.cancel()


@synchronous
async def test_a_request_that_waits_past_the_timeout_is_refused_and_leaves_the_queue():
    queue = AdmissionQueue(QueueLimits(parallel=1, timeout_s=0.05))
    await _occupy(queue)
    with pytest.raises(Overloaded, match="--queue-timeout"):
        await queue.admit("m", 5, None, warm=True)
    assert queue.depth() == 0


@synchronous
async def test_a_cancelled_waiter_leaves_the_queue_and_an_admitted_one_frees_its_slot():
    queue = AdmissionQueue(QueueLimits(parallel=1))
    first = await _occupy(queue)
    waiting = asyncio.create_task(queue.admit("m", 5, None, warm=True))
    await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.sleep(0.01)
    assert queue.depth() == 0
    queue.release(first)
    assert queue.running("m") == 0
    second = await _occupy(queue)
    assert queue.running("m") == 1
    queue.release(second)


@synchronous
async def test_client_tiers_cap_queued_requests_and_clamp_priority():
    tier = Tier(name="free", max_concurrent=1, max_queued=1, priority_min=5, priority_max=9)
    queue = AdmissionQueue(QueueLimits(parallel=8),
                           ClientTiers(tiers={"free": tier}, clients={"bob": "free"}))
    running = await queue.admit("m", 0, "bob", warm=True)
    assert running.priority == 5  # asked for 0, the tier allows 5..9
    queued = asyncio.create_task(queue.admit("m", 5, "bob", warm=True))
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded, match="'bob' has 1 request"):
        await queue.admit("m", 5, "bob", warm=True)
    other = await queue.admit("m", 5, "alice", warm=True)  # not in a tier: no caps
    queue.release(running)
    assert (await queued).client == "bob"
    queue.release(other)


def test_admissible_gives_a_model_no_more_than_its_tickets_slots():
    waiting = [Ticket(model="painter", priority=5, warm=True, client=None, tier=None, seq=i,
                      arrived=0.0, slots=1) for i in range(3)] + [ticket("chat", seq=3)]
    assert [t.seq for t in admissible(waiting, Counter(), Counter(), parallel=8)] == [0, 3]
    chosen = admissible(waiting, Counter({"painter": 1}), Counter(), parallel=8)
    assert [t.seq for t in chosen] == [3]
