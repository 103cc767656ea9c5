"""The runner's side of the KV grant: the KV cache grows only as far as the node agrees.

A model's KV capacity is what it may need (engine/kv_budget.py), but its runner may touch
only the blocks the node has granted. It starts with KV_GRANT_STEP_TOKENS tokens' worth
(what placement reserved for it) and, when the blocks its requests hold come within half a
step of the grant, or an allocation lacked blocks, asks for another step (AskKV). The node
grants it only if its budget still has the room (cluster/node_budget.py counts every
runner's grant as held), else the grant stays and the runner asks again ASK_RETRY_S later;
meanwhile its requests wait or are preempted as in any full pool. One ask is out at a time,
so a runner holds at most its grant, and the node never grants past its budget.

Once the runner has been idle IDLE_RELEASE_S, it gives back the pages of its free blocks
above the first step (the prefix cache there goes with them) and tells the supervisor its
smaller grant (ReleasedKV), so what it holds shrinks again after a burst.

Runs on the loop's thread between steps; a check is a stats() read every GRANT_CHECK_S.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shoal.engine.core import EngineCore
from shoal.engine.kv_budget import KV_GRANT_STEP_TOKENS
from shoal.runner.messages import AskKV, GrantKV, ReleasedKV

GRANT_CHECK_S = 0.05  # how often the loop looks at the grant while it steps
ASK_RETRY_S = 2.0  # after a refusal, the next ask waits this long
IDLE_RELEASE_S = 30.0  # idle this long, the runner gives back its KV beyond the first step


@dataclass(frozen=True)
class GrantFigures:
    used: int  # blocks requests hold
    granted: int  # blocks the pool may touch
    total: int  # the pool's capacity
    short: int  # the most blocks an allocation lacked since the grant last changed


def grant_figures(stats: dict[str, Any]) -> GrantFigures | None:
    """The grant's figures from engine.stats(); None for an engine without a grant."""
    names = ("kv_blocks_used", "kv_blocks_granted", "kv_blocks_total")
    values = [stats.get(name) for name in names]
    if not all(isinstance(v, int) for v in values):
        return None
    short = stats.get("kv_blocks_short")
    return GrantFigures(*values, short=short if isinstance(short, int) else 0)


def blocks_to_ask(figures: GrantFigures, step_blocks: int) -> int:
    """How many more blocks to ask for now: a step (or what an allocation lacked, if more)
    once requests hold all but half a step of the grant; 0 while there is room, or when the
    grant is the whole capacity."""
    room = figures.total - figures.granted
    if room <= 0:
        return 0
    if figures.short == 0 and figures.granted - figures.used >= step_blocks // 2:
        return 0
    return min(room, max(step_blocks, figures.short))


class KVGrantKeeper:
    """Sets the engine's first grant and asks the node for more as its requests grow."""

    def __init__(self, engine: EngineCore, send: Callable[[AskKV | ReleasedKV], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engine = engine
        self._send = send
        self._clock = clock
        self._per_block = engine.kv_bytes_per_block()
        self._enabled = (self._per_block is not None and self._per_block > 0
                         and grant_figures(engine.stats()) is not None)
        self.step_blocks = math.ceil(KV_GRANT_STEP_TOKENS / engine.config.block_size)
        self._asking = False
        self._refused = False  # the node's last answer kept the grant as it was
        self._next_check = 0.0
        self._idle_since: float | None = None  # when the loop last began to rest
        self._rested = False  # this idle spell's release is done

    def start(self) -> None:
        """The first grant: one step, what placement reserved for the model's KV."""
        if self._enabled:
            self._engine.grant_kv_blocks(self.step_blocks)

    @property
    def starved(self) -> bool:
        """Nothing runs, a waiting request lacks blocks the grant would give, and the node
        refused the last ask: stepping cannot help until it grants (or a request ends)."""
        if not self._refused or self._asking:
            return False  # cheap on the step path: stats() only after a refusal
        stats = self._engine.stats()
        figures = grant_figures(stats)
        return (figures is not None and figures.short > 0
                and figures.granted < figures.total and not stats.get("num_running"))

    def seconds_until_due(self) -> float:
        return max(0.0, self._next_check - self._clock())

    def maybe_ask(self) -> None:
        """Ask for a step more if the grant runs short (cheap when no check is due)."""
        now = self._clock()
        if not self._enabled or self._asking or now < self._next_check:
            return
        self._next_check = now + GRANT_CHECK_S
        figures = grant_figures(self._engine.stats())
        if figures is None:
            return
        more = blocks_to_ask(figures, self.step_blocks)
        if more > 0:
            assert self._per_block is not None  # enabled
            self._asking = True
            self._send(AskKV(granted_blocks=figures.granted, more_blocks=more,
                             bytes_per_block=self._per_block))

    def busy(self) -> None:
        """The loop stepped: the idle clock starts again at the next rest."""
        self._idle_since = None
        self._rested = False

    def rest(self) -> None:
        """The loop has nothing to step: after IDLE_RELEASE_S of that, give back the pages
        of the free blocks above the first step (once per idle spell)."""
        if not self._enabled or self._rested:
            return
        now = self._clock()
        if self._idle_since is None:
            self._idle_since = now
        if self._asking or now - self._idle_since < IDLE_RELEASE_S:
            return
        self._rested = True
        if self._engine.release_kv_blocks(self.step_blocks) > 0:
            figures = grant_figures(self._engine.stats())
            assert self._per_block is not None and figures is not None  # enabled
            self._send(ReleasedKV(granted_blocks=figures.granted,
                                  bytes_per_block=self._per_block))

    def seconds_until_release(self) -> float | None:
        """How long an idle loop may wait before rest() has something to do (None: never
        this idle spell)."""
        if not self._enabled or self._rested or self._asking or self._idle_since is None:
            return None  # an answer to the ask wakes the loop first
        return max(0.0, self._idle_since + IDLE_RELEASE_S - self._clock())

    def on_grant(self, message: GrantKV) -> None:
        """The node's answer: a larger grant takes effect now; an unchanged one (a refusal)
        puts the next ask ASK_RETRY_S off."""
        self._asking = False
        figures = grant_figures(self._engine.stats()) if self._enabled else None
        self._refused = figures is None or message.granted_blocks <= figures.granted
        if self._refused:
            self._next_check = self._clock() + ASK_RETRY_S
        else:
            self._engine.grant_kv_blocks(message.granted_blocks)
