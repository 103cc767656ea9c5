"""What rank 0 tells the other ranks each step, and what the sampling rank answers.

Rank 0 owns the scheduler. Before each forward pass it sends every other rank a StepPlan:
the chunks to compute (token ids, positions, block tables), the requests the sampling rank
must start tracking (prompt and sampling parameters) or forget, and the grammar masks of
constrained rows. While idle it sends keep-alive plans, and a shutdown plan at the end.
The last pipeline rank samples and answers with a SampledStep. Each new request's trace
travels once, so every rank records its own step spans in the request's trace.

With a KV disk tier (--kv-disk), each rank keeps its own share of every prefix block on its
own disk: a plan lists the prompt blocks rank 0 registered since the last one (`saved`,
copied by each rank before the plan's step runs), and a "prefix_load" plan asks every rank
to load stored blocks into the block ids rank 0 chose; each answers how many it loaded.
Prefix blocks moving between instances (kv/transfer.py) take two more: "prefix_read" (each
rank answers with its share of the listed blocks, encode_tensors) and "prefix_write" (rank
0 then sends each rank its share; each writes it at the listed block ids and answers how
many leading blocks it stored).

Both travel as msgpack (never pickle: a rank must not run code a peer sends it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import numpy as np
import torch

from shoal.engine.kv.prefix_cache import CachedBlock
from shoal.engine.kv.transfer import TransferError, tensor_from_wire, tensor_to_wire
from shoal.engine.sampler import SampledLogprobs
from shoal.engine.sampling import SamplingParams
from shoal.engine.scheduler_output import ScheduledChunk
from shoal.tracing.steps import RequestTrace

PlanKind = Literal["step", "keepalive", "shutdown", "prefix_load", "prefix_read",
                   "prefix_write"]


@dataclass(frozen=True)
class NewRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class PrefixLoad:
    """Blocks following parent_hash along block_hashes, which rank 0 wrote at placed's
    block ids ((index in block_hashes, block id)): loaded from its disk (prefix_load) or
    received (prefix_write). A prefix_read lists the block ids to read in placed."""

    parent_hash: bytes
    block_hashes: tuple[bytes, ...]
    placed: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class StepPlan:
    kind: PlanKind
    chunks: tuple[ScheduledChunk, ...] = ()
    added: tuple[NewRequest, ...] = ()
    removed: tuple[str, ...] = ()
    # request id -> bool [vocab] of the tokens its grammar allows next
    allowed: dict[str, torch.Tensor] = field(default_factory=dict)
    # new requests' traces (sent once; a removed id is forgotten): each rank's step spans
    traced: dict[str, RequestTrace] = field(default_factory=dict)
    # prompt blocks registered since the last plan, for each rank's disk tier
    saved: tuple[CachedBlock, ...] = ()
    prefix_load: PrefixLoad | None = None  # the prefix_* kinds

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True)
class SampledStep:
    """One token per sampled chunk, in chunk order, with logprobs where asked for."""

    token_ids: tuple[int, ...]
    logprobs: tuple[SampledLogprobs | None, ...]


def encode_plan(plan: StepPlan) -> bytes:
    return msgpack.packb({
        "kind": plan.kind,
        "chunks": [[c.request_id, list(c.token_ids), c.start_position, list(c.block_ids),
                    c.needs_sample, c.prompt] for c in plan.chunks],
        "added": [[r.request_id, list(r.prompt_token_ids), _params_to_wire(r.params)]
                  for r in plan.added],
        "removed": list(plan.removed),
        "allowed": {rid: [int(mask.numel()), np.packbits(mask.cpu().numpy()).tobytes()]
                    for rid, mask in plan.allowed.items()},
        "traced": {rid: [trace.trace_id, trace.span_id] for rid, trace in plan.traced.items()},
        "saved": [[b.block_id, b.block_hash, b.parent_hash, list(b.token_ids)]
                  for b in plan.saved],
        "prefix_load": None if (load := plan.prefix_load) is None else
        [load.parent_hash, list(load.block_hashes), [list(p) for p in load.placed]],
    }, use_bin_type=True)


def decode_plan(data: bytes) -> StepPlan:
    raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    chunks = tuple(ScheduledChunk(request_id=rid, token_ids=tuple(tokens),
                                  start_position=start, block_ids=tuple(blocks),
                                  needs_sample=sample, prompt=prompt)
                   for rid, tokens, start, blocks, sample, prompt in raw["chunks"])
    added = tuple(NewRequest(rid, tuple(prompt), _params_from_wire(params))
                  for rid, prompt, params in raw["added"])
    allowed = {rid: torch.from_numpy(np.unpackbits(np.frombuffer(bits, dtype=np.uint8),
                                                   count=size).astype(bool))
               for rid, (size, bits) in raw["allowed"].items()}
    traced = {rid: RequestTrace(trace_id, span_id)
              for rid, (trace_id, span_id) in raw["traced"].items()}
    saved = tuple(CachedBlock(block_id, block_hash, parent_hash, tuple(tokens))
                  for block_id, block_hash, parent_hash, tokens in raw["saved"])
    load = raw["prefix_load"]
    prefix_load = None if load is None else PrefixLoad(
        load[0], tuple(load[1]), tuple((int(i), int(b)) for i, b in load[2]))
    return StepPlan(kind=raw["kind"], chunks=chunks, added=added,
                    removed=tuple(raw["removed"]), allowed=allowed, traced=traced,
                    saved=saved, prefix_load=prefix_load)


def encode_tensors(tensors: tuple[torch.Tensor, ...]) -> bytes:
    return msgpack.packb([tensor_to_wire(t) for t in tensors], use_bin_type=True)


def decode_tensors(data: bytes) -> tuple[torch.Tensor, ...]:
    """TransferError when malformed."""
    try:
        specs = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as error:
        raise TransferError(f"malformed tensors: {error}") from None
    if not isinstance(specs, list):
        raise TransferError("malformed tensors: not a list")
    return tuple(tensor_from_wire(spec) for spec in specs)


def encode_sampled(step: SampledStep) -> bytes:
    logprobs = [None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]]
                for lp in step.logprobs]
    return msgpack.packb({"tokens": list(step.token_ids), "logprobs": logprobs},
                         use_bin_type=True)


def decode_sampled(data: bytes) -> SampledStep:
    raw = msgpack.unpackb(data, raw=False)
    logprobs = tuple(None if lp is None else
                     SampledLogprobs(token_id=lp[0], logprob=lp[1],
                                     top=[(int(t), float(p)) for t, p in lp[2]])
                     for lp in raw["logprobs"])
    return SampledStep(token_ids=tuple(raw["tokens"]), logprobs=logprobs)


def _params_to_wire(params: SamplingParams) -> dict[str, Any]:
    wire = dataclasses.asdict(params)
    wire["stop"] = list(params.stop)
    wire["stop_token_ids"] = list(params.stop_token_ids)
    return wire


def _params_from_wire(wire: dict[str, Any]) -> SamplingParams:
    wire = dict(wire)
    wire["stop"] = tuple(wire["stop"])
    wire["stop_token_ids"] = tuple(wire["stop_token_ids"])
    wire["logit_bias"] = {int(k): float(v) for k, v in wire["logit_bias"].items()}
    return SamplingParams(**wire)
