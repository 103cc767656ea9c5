"""Token-budget scheduler with continuous batching, chunked prefill and a prefix cache.

Pure Python, no torch. Every step has one budget of tokens. Running requests in decode get
theirs first (one token each), then running requests part-way through their prompt, then
waiting requests are admitted in (priority, arrival) order while budget, sequence slots and
KV blocks last. A long prompt is simply a request whose owed tokens exceed the budget left,
so it gets a chunk now and the rest in later steps. When a running request needs a block and
none is free, the lowest-priority, most recently arrived running request is preempted by
recompute: it drops its blocks and goes back to the waiting queue with nothing computed.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shoal.engine.errors import ContextLengthExceeded
from shoal.engine.kv.block_pool import BlockPool
from shoal.engine.kv.prefix_cache import ROOT_HASH, CachedBlock, extend_block_hashes
from shoal.engine.outputs import FinishReason
from shoal.engine.request import Request, RequestStatus
from shoal.engine.scheduler_output import ScheduledChunk, SchedulerOutput


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_prefix_caching: bool = True
    # Keep a list of newly registered prompt blocks (drain_cached_blocks) for the disk tier.
    record_cached_blocks: bool = False

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs",
                     "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs, so every "
                             "running request can decode in one step")


class Scheduler:
    def __init__(self, config: SchedulerConfig, eos_token_ids: Iterable[int] = ()) -> None:
        self.config = config
        self.block_size = config.block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        # A lone request must always fit the pool, or it would preempt itself forever.
        self.max_model_len = min(config.max_model_len, config.num_blocks * config.block_size)
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self._requests: dict[str, Request] = {}
        self._waiting: list[Request] = []   # sorted by Request.sort_key
        self._running: list[Request] = []   # sorted by Request.sort_key
        self._next_arrival = 0
        self.num_preemptions = 0
        self._cached_blocks: list[CachedBlock] = []

    # ---- queries ------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def decoding(self) -> list[Request]:
        """Running requests whose next step computes one generated token."""
        return [r for r in self._running if r.num_tokens - r.num_computed_tokens == 1]

    def drain_cached_blocks(self) -> list[CachedBlock]:
        """Prompt blocks registered since the last call (record_cached_blocks): their KV
        is valid until the next schedule() may hand a freed one to another request."""
        drained, self._cached_blocks = self._cached_blocks, []
        return drained

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def stats(self) -> dict:
        cache = self.pool.prefix_cache
        return {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_used": self.pool.num_used_blocks,
            # Free blocks still holding memory: prefix-cache entries and spent blocks.
            "kv_blocks_cached": self.pool.num_resident_free_blocks,
            "kv_blocks_granted": self.pool.granted_blocks,
            # The most blocks a request lacked for want of a grant since the grant changed.
            "kv_blocks_short": self.pool.shortfall_blocks,
            "kv_usage": self.pool.usage,
            "prefix_cache_blocks": len(cache),
            "prefix_cache_query_tokens": cache.query_tokens,
            "prefix_cache_hit_tokens": cache.hit_tokens,
            "prefix_cache_hit_requests": cache.hit_requests,
            "num_preemptions": self.num_preemptions,
        }

    # ---- request lifecycle --------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a new request; raises ContextLengthExceeded if it can never run."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        prompt_len = len(request.prompt_token_ids)
        if prompt_len >= self.max_model_len:
            raise ContextLengthExceeded(
                f"the prompt has {prompt_len} tokens; the context holds {self.max_model_len} "
                f"including at least one generated token")
        request.arrival_index = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        bisect.insort(self._waiting, request, key=lambda r: r.sort_key)

    def abort(self, request_id: str) -> None:
        """Drop a waiting or running request and its blocks; unknown ids are ignored."""
        self.finish(request_id, "abort")

    def finish(self, request_id: str, reason: FinishReason) -> None:
        """End a request for a reason decided outside (stop string, abort)."""
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, reason)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        elif request in self._waiting:
            self._waiting.remove(request)
        self._release_blocks(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._requests[request.request_id]

    def _release_blocks(self, request: Request) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.num_registered_blocks = 0

    # ---- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's chunks. Changes block tables and queues, not computed counts."""
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}   # request id -> tokens this step, in chunk order
        preempted: list[str] = []
        decodes = [r for r in self._running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self._running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop to make room
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if request.draft_token_ids:
                num_new += self._fit_drafts(request, budget - num_new)
            if self._reserve_blocks(request, num_new, scheduled, preempted):
                scheduled[request.request_id] = num_new
            budget = self.config.max_num_batched_tokens - sum(scheduled.values())
        if not preempted:
            # Blocks are short this step; admitting now would only thrash.
            self._admit_waiting(budget, scheduled)
        chunks = tuple(self._make_chunk(self._requests[rid], n) for rid, n in scheduled.items())
        return SchedulerOutput(chunks=chunks, preempted_ids=tuple(preempted))

    def _fit_drafts(self, request: Request, budget: int) -> int:
        """Keep as many of a decoding request's drafts as the step's budget, the context and
        free blocks allow (guesses never preempt anyone); returns how many remain."""
        drafts = request.draft_token_ids
        free_slots = ((len(request.block_ids) + self.pool.num_free_blocks) * self.block_size
                      - request.num_tokens)
        room = min(budget, self.max_model_len - request.num_tokens - 1, free_slots)
        del drafts[max(room, 0):]
        return len(drafts)

    def _reserve_blocks(self, request: Request, num_new: int, scheduled: dict[str, int],
                        preempted: list[str]) -> bool:
        """Grow request's block table to hold num_new more tokens, preempting others (or
        itself) when the pool is short. Returns False when the request itself was preempted."""
        needed = self._blocks_for(request.num_computed_tokens + num_new) - len(request.block_ids)
        while not self.pool.can_allocate(needed):
            victim = max(self._running, key=lambda r: r.sort_key)
            self._preempt(victim)
            preempted.append(victim.request_id)
            scheduled.pop(victim.request_id, None)
            if victim is request:
                return False
        request.block_ids.extend(self.pool.allocate(needed))
        return True

    def _preempt(self, request: Request) -> None:
        self._running.remove(request)
        request.draft_token_ids.clear()
        self._release_blocks(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Its (priority, arrival) key puts it ahead of every later arrival of its priority.
        bisect.insort(self._waiting, request, key=lambda r: r.sort_key)

    def _admit_waiting(self, budget: int, scheduled: dict[str, int]) -> None:
        """Move waiting requests to running in order while budget, slots and blocks last.
        Stops at the first that does not fit, so a big request is not starved by small ones."""
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting[0]
            cached_blocks = self._find_cached_prefix(request)
            num_computed = len(cached_blocks) * self.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            needed = self._blocks_for(num_computed + num_new) - len(cached_blocks)
            # Touching a free cached block takes it off the free list, so count those too.
            revived = sum(1 for b in cached_blocks if self.pool.is_free(b))
            if not self.pool.can_allocate(needed + revived):
                break
            self._waiting.pop(0)
            self._record_cache_lookup(request, num_computed)
            self.pool.touch(cached_blocks)
            request.block_ids = cached_blocks + self.pool.allocate(needed)
            request.num_registered_blocks = len(cached_blocks)
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            bisect.insort(self._running, request, key=lambda r: r.sort_key)
            scheduled[request.request_id] = num_new
            budget -= num_new

    def _find_cached_prefix(self, request: Request) -> list[int]:
        if not self.config.enable_prefix_caching:
            return []
        hashes = self._block_hashes(request)
        # Leave at least one token to compute, so the step yields logits to sample from.
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.pool.find_cached(hashes[:max_blocks])

    def _record_cache_lookup(self, request: Request, num_cached_tokens: int) -> None:
        if not self.config.enable_prefix_caching:
            return
        self.pool.prefix_cache.record_lookup(request.num_tokens, num_cached_tokens)
        if request.status is RequestStatus.WAITING:
            # Usage reports the first admission; a preempted request's re-hits are internal.
            request.num_cached_tokens = min(num_cached_tokens, len(request.prompt_token_ids))

    def _make_chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = min(start + num_new, request.num_tokens)
        drafts = tuple(request.draft_token_ids[:start + num_new - end])
        request.draft_token_ids.clear()
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=tuple(request.token_ids_slice(start, end)) + drafts,
            start_position=start,
            block_ids=tuple(request.block_ids),
            needs_sample=end == request.num_tokens,
            prompt=start < len(request.prompt_token_ids),
            num_drafts=len(drafts),
        )

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, request: Request) -> list[bytes]:
        """The request's full-block hashes, extended for tokens appended since last time."""
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            tokens = request.prompt_token_ids + request.output_token_ids
            extend_block_hashes(request.block_hashes, tokens, self.block_size,
                                len(request.prompt_token_ids))
        return request.block_hashes

    # ---- after the forward pass -------------------------------------------------------------

    def update(self, output: SchedulerOutput,
               sampled: Mapping[str, int | Sequence[int]]) -> list[Request]:
        """Record a step's results: advance computed counts, append sampled tokens, register
        newly full blocks in the prefix cache, and finish requests that hit a stop.

        sampled: per sampled chunk, its new token, or for a chunk with drafts the tokens
        verification kept: the accepted drafts, then one token of the model's own.
        Returns the requests that finished in this update."""
        finished: list[Request] = []
        for chunk in output.chunks:
            request = self._requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted since schedule(); its work is discarded
            if not chunk.needs_sample:
                request.num_computed_tokens += len(chunk.token_ids)
                self._register_full_blocks(request)
                continue
            if chunk.request_id not in sampled:
                raise ValueError(f"no sampled token for request {chunk.request_id!r}")
            new = sampled[chunk.request_id]
            tokens = [new] if isinstance(new, int) else list(new)
            accepted = len(tokens) - 1
            if not 0 <= accepted <= chunk.num_drafts:
                raise ValueError(f"request {chunk.request_id!r}: {len(tokens)} tokens for a "
                                 f"chunk with {chunk.num_drafts} drafts")
            # Rejected drafts' KV entries are simply not counted: later tokens overwrite them.
            request.num_computed_tokens += len(chunk.token_ids) - chunk.num_drafts + accepted
            request.num_draft_tokens += chunk.num_drafts
            request.num_accepted_tokens += accepted
            reason = None
            for token in tokens:
                request.append_output(token)
                reason = request.check_stop(self.eos_token_ids, self.max_model_len)
                if reason is not None:
                    break
            self._register_full_blocks(request)
            if reason is not None:
                self._finish(request, reason)
                finished.append(request)
            elif chunk.num_drafts:
                self._cut_tail(request)
        return finished

    def _cut_tail(self, request: Request) -> None:
        """Give back blocks reserved for rejected drafts (never cached: only computed full
        blocks are registered), keeping those the next token needs."""
        keep = self._blocks_for(request.num_tokens)
        if len(request.block_ids) > keep:
            self.pool.free(request.block_ids[keep:])
            del request.block_ids[keep:]

    def _register_full_blocks(self, request: Request) -> None:
        """Publish blocks whose every slot now holds computed KV entries."""
        if not self.config.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        hashes = self._block_hashes(request)
        prompt_blocks = len(request.prompt_token_ids) // self.block_size
        for index in range(request.num_registered_blocks, num_full):
            cached = self.pool.cache_block(hashes[index], request.block_ids[index])
            if cached and self.config.record_cached_blocks and index < prompt_blocks:
                size = self.block_size
                self._cached_blocks.append(CachedBlock(
                    request.block_ids[index], hashes[index],
                    hashes[index - 1] if index else ROOT_HASH,
                    tuple(request.prompt_token_ids[index * size:(index + 1) * size])))
        request.num_registered_blocks = num_full
