"""One step's forward pass over the ranks of an instance.

Rank 0 (LeaderExecutor) owns the scheduler: it sends each other rank the step plan, runs its
own part and returns one token per sampled chunk.
- tensor: every rank runs every layer on its heads; the layers sum their partial outputs
  across ranks; rank 0 samples from the logits it computed.
- expert: the same, every rank running every layer whole but for the routed experts, of
  which it runs its own; each mixture-of-experts layer sums its partial outputs.
- pipeline: hidden states [T, hidden] go rank to rank; the last rank computes the logits,
  samples (SamplingMirror) and sends the tokens back to rank 0.
The other ranks run Follower.run(): take a plan, do their part, until a shutdown plan, a
stop request, or a GroupError (rank 0 gone: no plan, not even a keep-alive, in time).
With a KV disk tier, each rank saves its share of the blocks a plan lists and answers a
"prefix_load" plan with how many stored blocks it loaded (kv/disk_prefixes.py). Prefix
blocks moving to or from another instance (kv/transfer.py, RankShares): each rank reads its
share for rank 0 ("prefix_read") or writes the share rank 0 sends it ("prefix_write").
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import msgpack
import torch

from shoal.engine.errors import GroupError
from shoal.engine.kv.disk_prefixes import RankTier
from shoal.engine.kv.prefix_cache import CachedBlock
from shoal.engine.kv.transfer import (
    Layout,
    PrefixBlocks,
    TransferError,
    check_tensors,
    layout_of,
    pick_blocks,
    read_blocks,
    write_blocks,
)
from shoal.engine.parallel.config import ParallelConfig
from shoal.engine.parallel.group import RankGroup
from shoal.engine.parallel.plan import (
    NewRequest,
    PrefixLoad,
    StepPlan,
    decode_plan,
    decode_sampled,
    decode_tensors,
    encode_plan,
    encode_sampled,
    encode_tensors,
)
from shoal.engine.parallel.sampling_mirror import SamplingMirror
from shoal.engine.sampler import Sampler, SamplerOutput, SamplingRow
from shoal.engine.scheduler_output import SchedulerOutput
from shoal.tracing.steps import RequestTrace, StepTracer

log = logging.getLogger("shoal.parallel")


class HiddenWire:
    """Hidden states between pipeline ranks: as computed, or int8 with one scale per token
    (a quarter of float32's bytes; costs accuracy, so it is opt-in)."""

    def __init__(self, group: RankGroup, hidden_size: int, dtype: torch.dtype,
                 compress: bool) -> None:
        self._group = group
        self._hidden_size = hidden_size
        self._dtype = dtype
        self._compress = compress

    def send(self, hidden: torch.Tensor, dst: int) -> None:
        if not self._compress:
            self._group.send_tensor(hidden.to(self._dtype), dst)
            return
        values = hidden.float()
        scale = values.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0  # [T, 1]
        self._group.send_tensor(torch.round(values / scale).to(torch.int8), dst)
        self._group.send_tensor(scale, dst)

    def recv(self, num_tokens: int, src: int) -> torch.Tensor:
        shape = (num_tokens, self._hidden_size)
        if not self._compress:
            return self._group.recv_tensor(shape, self._dtype, src)
        values = self._group.recv_tensor(shape, torch.int8, src)
        scale = self._group.recv_tensor((num_tokens, 1), torch.float32, src)
        return (values.float() * scale).to(self._dtype)


class Executor(Protocol):
    """How the engine runs one step's forward pass and sampling."""

    def step(self, scheduled: SchedulerOutput, rows: Sequence[SamplingRow],
             added: Sequence[NewRequest], removed: Sequence[str],
             traced: Mapping[str, RequestTrace]) -> SamplerOutput: ...

    def idle(self, removed: Sequence[str] = ()) -> None: ...

    def shutdown(self) -> None: ...

    # The other ranks' KV disk tiers (kv/disk_prefixes.py: RankDisks).
    def queue_saves(self, blocks: Sequence[CachedBlock]) -> None: ...

    def agree_prefix(self, blocks: PrefixBlocks, placed: list[tuple[int, int]]) -> int: ...


class LocalExecutor:
    """A model served whole by this process."""

    def __init__(self, runner, sampler: Sampler) -> None:
        self._runner = runner
        self._sampler = sampler

    def step(self, scheduled: SchedulerOutput, rows: Sequence[SamplingRow],
             added: Sequence[NewRequest] = (), removed: Sequence[str] = (),
             traced: Mapping[str, RequestTrace] | None = None) -> SamplerOutput:
        logits = self._runner.execute(scheduled)  # [num_sampled, vocab] float32
        return self._sampler(logits, rows)

    def idle(self, removed: Sequence[str] = ()) -> None:
        pass

    def shutdown(self) -> None:
        pass

    # No other ranks: the disk tier's blocks are this rank's alone (kv/disk_prefixes.py).
    def queue_saves(self, blocks: Sequence[CachedBlock]) -> None:
        pass

    def agree_prefix(self, blocks: PrefixBlocks, placed: list[tuple[int, int]]) -> int:
        return blocks.num_blocks


class LeaderExecutor:
    """Rank 0's side of every step."""

    def __init__(self, runner, sampler: Sampler, group: RankGroup, config: ParallelConfig,
                 wire: HiddenWire, share_layouts: tuple[Layout, ...]) -> None:
        self.share_layouts = share_layouts  # ranks 1.. (RankShares, kv/transfer.py)
        self._runner = runner
        self._sampler = sampler
        self._group = group
        self._config = config
        self._wire = wire
        self._last_sent = time.monotonic()
        self._saved: list[CachedBlock] = []  # for the other ranks' disk tiers, next plan

    def step(self, scheduled: SchedulerOutput, rows: Sequence[SamplingRow],
             added: Sequence[NewRequest], removed: Sequence[str],
             traced: Mapping[str, RequestTrace] | None = None) -> SamplerOutput:
        sampled_ids = [c.request_id for c in scheduled.chunks if c.needs_sample]
        allowed = {rid: row.allowed_tokens for rid, row in zip(sampled_ids, rows)
                   if row.allowed_tokens is not None}
        self._send_plan(StepPlan(kind="step", chunks=scheduled.chunks, added=tuple(added),
                                 removed=tuple(removed), allowed=allowed,
                                 traced=dict(traced or {})))
        if self._config.runs_every_layer:
            logits = self._runner.execute(scheduled)  # [S, V]; layers sum across ranks
            return self._sampler(logits, rows)
        hidden = self._runner.execute(scheduled)  # [T, hidden] of this rank's layers
        self._wire.send(hidden, 1)
        answer = decode_sampled(self._group.recv_bytes(self._config.world_size - 1))
        return SamplerOutput(token_ids=list(answer.token_ids), logprobs=list(answer.logprobs))

    @property
    def wait_s(self) -> float:
        """Seconds rank 0 has spent blocked on the other ranks."""
        return self._group.wait_s

    def idle(self, removed: Sequence[str] = ()) -> None:
        """While no step runs: a keep-alive (carrying any removals) every keepalive_s, and
        at once when there are blocks to save."""
        if removed or self._saved or \
                time.monotonic() - self._last_sent >= self._config.keepalive_s:
            self._send_plan(StepPlan(kind="keepalive", removed=tuple(removed)))

    def queue_saves(self, blocks: Sequence[CachedBlock]) -> None:
        """Prompt blocks just registered: every rank saves its share (with the next plan,
        before that plan's step can reuse them)."""
        self._saved.extend(blocks)

    def agree_prefix(self, blocks: PrefixBlocks, placed: list[tuple[int, int]]) -> int:
        """Every other rank loads `blocks` from its own disk into the block ids rank 0 wrote
        them to; how many leading blocks all of them loaded."""
        order = PrefixLoad(blocks.parent_hash, blocks.block_hashes, tuple(placed))
        self._send_plan(StepPlan(kind="prefix_load", prefix_load=order))
        count = blocks.num_blocks
        for rank in range(1, self._config.world_size):
            count = min(count, int(msgpack.unpackb(self._group.recv_bytes(rank))))
        return count

    def read_prefix(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Every other rank's copy of these blocks' slots, rank after rank (checked
        against the layout each rank declared at start)."""
        placed = tuple(enumerate(block_ids))
        self._send_plan(StepPlan(kind="prefix_read", prefix_load=PrefixLoad(b"", (), placed)))
        slots = len(block_ids) * self._runner.block_size
        tensors: list[torch.Tensor] = []
        for rank, layout in enumerate(self.share_layouts, start=1):
            share = decode_tensors(self._group.recv_bytes(rank))
            check_tensors(share, layout, slots)
            tensors.extend(share)
        return tuple(tensors)

    def write_prefix(self, blocks: PrefixBlocks, placed: list[tuple[int, int]],
                     shares: Sequence[tuple[torch.Tensor, ...]]) -> int:
        """Each other rank writes its share of the placed blocks at their block ids; how
        many leading blocks of `blocks` all of them stored."""
        order = PrefixLoad(blocks.parent_hash, blocks.block_hashes, tuple(placed))
        self._send_plan(StepPlan(kind="prefix_write", prefix_load=order))
        indices = [index for index, _ in placed]
        for rank, share in enumerate(shares, start=1):
            picked = pick_blocks(dataclasses.replace(blocks, tensors=share), indices)
            self._group.send_bytes(encode_tensors(picked), rank)
        count = blocks.num_blocks
        for rank in range(1, self._config.world_size):
            count = min(count, int(msgpack.unpackb(self._group.recv_bytes(rank))))
        return count

    def shutdown(self) -> None:
        """Tell the other ranks to stop (best effort: some may be gone), then leave."""
        try:
            self._send_plan(StepPlan(kind="shutdown"))
        except GroupError as error:
            log.warning("could not tell every rank to stop: %s", error)
        finally:
            self._group.close()

    def _send_plan(self, plan: StepPlan) -> None:
        if self._saved:
            plan = dataclasses.replace(plan, saved=tuple(self._saved))
            self._saved = []
        data = encode_plan(plan)
        for rank in range(1, self._config.world_size):
            self._group.send_bytes(data, rank)
        self._last_sent = time.monotonic()


class Follower:
    """A rank other than 0: mirrors rank 0's steps until told to stop."""

    def __init__(self, runner, group: RankGroup, config: ParallelConfig, wire: HiddenWire,
                 mirror: SamplingMirror | None, tracer: StepTracer | None = None,
                 disk: RankTier | None = None) -> None:
        self._runner = runner
        self._group = group
        self._disk = disk  # this rank's KV disk tier
        self._config = config
        self._wire = wire
        self._mirror = mirror  # the last pipeline rank's sampling state
        self.tracer = tracer or StepTracer(rank=config.rank)  # this rank's step spans
        self.steps = 0

    def run(self, stop_requested: Callable[[], bool] = lambda: False) -> None:
        """Serve plans; returns on a shutdown plan or a stop request; GroupError when rank 0
        falls silent (its keep-alives bound the wait) or a peer dies."""
        busy = False  # the last plan was a step: the next one is due within a token's time
        try:
            while not stop_requested():
                plan = decode_plan(self._group.recv_bytes(0, spin=busy))
                if plan.saved and self._disk is not None:
                    self._disk.save(plan.saved)
                if plan.kind == "shutdown":
                    return
                if plan.kind in ("prefix_load", "prefix_read", "prefix_write"):
                    self._answer_prefix(plan.kind, plan.prefix_load)
                    continue
                if self._mirror is not None:
                    self._mirror.apply(plan)
                for request_id, trace in plan.traced.items():
                    self.tracer.begin(request_id, trace)
                busy = plan.kind == "step"
                if busy:
                    started_ns = time.time_ns()
                    self._step(plan)
                    self.tracer.step(plan.chunks, started_ns, time.time_ns())
                for request_id in plan.removed:
                    self.tracer.end(request_id)
        finally:
            if self._disk is not None:
                self._disk.close()  # writes out what is queued
            self._group.close()

    def _answer_prefix(self, kind: str, order: PrefixLoad | None) -> None:
        cache, size = self._runner.block_tensors(), self._runner.block_size
        block_ids = [block_id for _, block_id in order.placed] if order is not None else []
        if kind == "prefix_read":
            self._group.send_bytes(encode_tensors(read_blocks(cache, block_ids, size)), 0)
            return
        count = 0
        if kind == "prefix_write":
            # The blocks were verified on rank 0 against the layout this rank declared;
            # checked again here, as anything a peer sends.
            try:
                share = decode_tensors(self._group.recv_bytes(0))
                check_tensors(share, layout_of(cache), len(block_ids) * size)
                write_blocks(cache, block_ids, size, share)
                count = len(order.block_hashes)
            except TransferError as error:
                log.warning("rank %d refused its share of prefix blocks: %s",
                            self._config.rank, error)
        elif self._disk is not None and order is not None:
            count = self._disk.load(order.parent_hash, order.block_hashes, order.placed)
        self._group.send_bytes(msgpack.packb(count), 0)

    def _step(self, plan: StepPlan) -> None:
        scheduled = SchedulerOutput(chunks=plan.chunks)
        config = self._config
        if config.runs_every_layer:
            self._runner.execute(scheduled)  # rank 0 samples; these logits go unused
        else:
            prepared = self._runner.prepare(scheduled)  # while the rank before computes
            hidden = self._wire.recv(plan.num_tokens, config.rank - 1)
            out = self._runner.execute_prepared(prepared, hidden)
            if config.is_last:
                step = self._mirror.sample(out, plan)  # type: ignore[union-attr]
                self._group.send_bytes(encode_sampled(step), 0)
            else:
                self._wire.send(out, config.rank + 1)
        self.steps += 1
