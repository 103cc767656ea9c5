"""The synchronous engine core: add requests, step, collect outputs.

One `step()` is one scheduler decision, one batched forward pass and one batched sampling
pass. Detokenization and stop strings are applied here, so every RequestOutput carries
clean text deltas. The engine imports no asyncio, HTTP or cluster code.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import torch

from shoal.engine.backends.fused_decode import FUSED_MAX_ROWS
from shoal.engine.config import EngineConfig
from shoal.engine.core import EngineTask, NoEmbedding, NotFollower, ProgressCallback
from shoal.engine.errors import check_context
from shoal.engine.grammar import GrammarCompiler
from shoal.engine.grammar_spec import GrammarSpec
from shoal.engine.kv.block_pool import BlockPool
from shoal.engine.kv.tensors import release_slots
from shoal.engine.kv.disk_prefixes import open_disk_prefixes
from shoal.engine.kv.transfer import PrefixBlocks, PrefixTransfer
from shoal.engine.kv_budget import check_weights_fit, kv_bytes_per_block, plan_kv_cache
from shoal.engine.model_runner import ModelRunner
from shoal.engine.models.loader import load_model
from shoal.engine.output_text import OutputText
from shoal.engine.outputs import FinishReason, RequestOutput, TokenLogprob, TopLogprob
from shoal.engine.parallel.executor import Executor, LeaderExecutor, LocalExecutor
from shoal.engine.parallel.plan import NewRequest
from shoal.engine.parallel.setup import set_up_rank
from shoal.engine.request import Request
from shoal.engine.sampler import Sampler, SamplingRow, position_generator
from shoal.engine.sampling import InvalidParameter, SamplingParams
from shoal.engine.scheduler import Scheduler, SchedulerConfig
from shoal.engine.scheduler_output import ScheduledChunk
from shoal.engine.speculation.draft import DraftModel
from shoal.engine.speculation.speculator import Speculator
from shoal.engine.speculation.verify import kept_tokens
from shoal.engine.tokenizer.detokenizer import IncrementalDetokenizer, StopChecker
from shoal.engine.tokenizer.tokenizer import Tokenizer
from shoal.tracing.steps import RequestTrace, StepTracer

log = logging.getLogger(__name__)


class Engine(NoEmbedding, NotFollower):
    """Loads one model and serves many concurrent requests with continuous batching."""

    task: EngineTask = "generate"

    def __init__(self, config: EngineConfig, progress: ProgressCallback | None = None) -> None:
        self.config = config
        report = progress or (lambda _stage, _fraction: None)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        if config.parallel is None:  # a rank's share was checked when it was placed
            check_weights_fit(config.source, limit_bytes=config.memory_limit_bytes)
        report("tokenizer", 0.0)
        self.tokenizer = Tokenizer.load(config.source, cache_dir=config.cache_dir)
        self.sampler = Sampler(eos_token_ids=self.tokenizer.eos_token_ids)
        if config.parallel is None:
            self.loaded = load_model(config.source, config.dtype, device=config.device,
                                     progress=lambda f: report("weights", f),
                                     kv_cache_dtype=config.kv_cache_dtype)
            kv_plan = plan_kv_cache(config, self.loaded.config, self.loaded)
            num_blocks, self.max_model_len = kv_plan.num_blocks, kv_plan.max_model_len
            self.runner = ModelRunner(self.loaded, num_blocks, config.block_size, config.device,
                                      kv_plan.row_buffer_tokens)
            self.executor: Executor = LocalExecutor(self.runner, self.sampler)
            ranks = None  # no other ranks hold shares of the KV
        else:
            setup = set_up_rank(config, report, tuple(self.tokenizer.eos_token_ids))
            self.loaded = setup.loaded
            num_blocks, self.max_model_len = setup.num_blocks, setup.max_model_len
            self.runner = ModelRunner(self.loaded, num_blocks, config.block_size, config.device,
                                      setup.row_buffer_tokens)
            self.executor = ranks = LeaderExecutor(self.runner, self.sampler, setup.group,
                                                   config.parallel, setup.hidden_wire(),
                                                   setup.share_layouts)
        self.model_id = config.source.model_id
        self.vocab_size = self.loaded.config.vocab_size
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=num_blocks,
                block_size=config.block_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                enable_prefix_caching=config.enable_prefix_caching,
                record_cached_blocks=config.kv_disk is not None,
            ),
            eos_token_ids=self.tokenizer.eos_token_ids,
        )
        self.transfer = PrefixTransfer(self.scheduler.pool, self.runner.block_tensors,
                                       config.block_size, ranks)
        self.disk = open_disk_prefixes(config, self.loaded, self.transfer, self.scheduler,
                                       self.executor)
        self.grammars = GrammarCompiler(self.tokenizer.backend, self.vocab_size,
                                        self.tokenizer.eos_token_ids)
        # Guessed tokens are verified by this process's sampler: a model served whole only.
        self.draft: DraftModel | None = None
        self.speculator: Speculator | None = None
        if config.parallel is None:
            if config.speculative is not None and config.speculative.method == "draft":
                report("draft", 0.0)
                self.draft = DraftModel.for_target(config, self.tokenizer, num_blocks,
                                                   self.vocab_size)
            self.speculator = Speculator(config.speculative, self.model_id, self.draft)
        self._requests: dict[str, Request] = {}
        self._states: dict[str, OutputText] = {}
        self._aborted: list[str] = []
        # Requests the sampling rank of a pipeline must start or stop tracking.
        self._mirrors = config.parallel is not None and config.parallel.sharding == "pipeline"
        self._added: list[NewRequest] = []
        # Requests the other ranks must forget (pipeline: sampling state; all: trace ids).
        self._removed: list[str] = []
        # New requests' traces, for the other ranks' own step spans.
        self._traced: dict[str, RequestTrace] = {}
        self.tracer = StepTracer()  # the runner reads its spans (GET /v1/traces/{id})
        report("ready", 1.0)
        log.info("engine ready: %s, %d KV blocks of %d, context %d, compute %s",
                 self.model_id, num_blocks, config.block_size, self.max_model_len,
                 self.loaded.compute_dtype)

    # ---- requests -------------------------------------------------------------------------

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    variables: dict[str, Any] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tools=tools, variables=variables)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, grammar: GrammarSpec | None = None,
                    priority: int = 0, trace: RequestTrace | None = None) -> None:
        """Queue a request; raises InvalidParameter, ContextLengthExceeded or InvalidGrammar.
        priority: lower is admitted first and preempted last (the request's x_priority).
        trace: the trace its steps are recorded in (every rank records its own).

        With a grammar, every sampled token is one the grammar accepts, and the request ends
        ("stop") as soon as the grammar is complete."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        params.check_vocab(self.vocab_size)
        check_context(len(prompt_token_ids), params.max_tokens, self.max_model_len)
        constraint = self.grammars.compile(grammar) if grammar is not None else None
        request = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                          params=params, priority=priority)
        if self.speculator is not None:
            self.speculator.add(request_id, request.prompt_token_ids, params,
                                constrained=constraint is not None)
        try:
            self.scheduler.add(request)
        except Exception:
            self._forget_guesses(request_id)
            raise
        if self.disk is not None:
            self.disk.arrived(request_id)
        if self._mirrors:
            self._added.append(NewRequest(request_id, tuple(prompt_token_ids), params))
        self._requests[request_id] = request
        self.tracer.begin(request_id, trace, time.time_ns())
        if trace is not None and self.config.parallel is not None:
            self._traced[request_id] = trace
        self._states[request_id] = OutputText(
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                               params.skip_special_tokens),
            stop_checker=StopChecker(params.stop),
            constraint=constraint,
        )

    def abort_request(self, request_id: str) -> None:
        if request_id in self._requests:
            self.scheduler.abort(request_id)
            self._aborted.append(request_id)

    def export_prefix(self, token_ids: list[int],
                      max_blocks: int | None = None) -> PrefixBlocks | None:
        """The KV of the longest prefix of token_ids (read as a prompt) that this engine
        holds in full blocks, copied to the CPU; None when it holds none. Between steps."""
        return self.transfer.export(token_ids, max_blocks)

    def import_prefix(self, blocks: PrefixBlocks) -> int:
        """Verify prefix blocks (hash chain, shapes, dtypes, finite values) and store the
        ones not cached yet, so a prompt starting with them skips computing them; a split
        model's ranks each store their share (blocks from an instance split the same way).
        Returns how many were stored (0 when the pool is too full); TransferError when they
        fail verification. Between steps."""
        return self.transfer.import_instance(blocks)

    def prefix_pool(self) -> BlockPool | None:
        return self.scheduler.pool if self.config.enable_prefix_caching else None

    def kv_layout_key(self) -> str:
        """How the model is split (the layers of each pipeline rank follow from its cache
        tensors, one per layer) and the shapes and dtypes of every rank's cache tensors."""
        parallel = self.config.parallel
        part = "whole"
        if parallel is not None:
            layers = [len(self.transfer.layout)] + [len(share) for share in
                                                    self.executor.share_layouts]
            part = (f"{parallel.sharding}x{parallel.world_size}:"
                    f"{parallel.layer_start}+{'/'.join(map(str, layers))}")
        layout = repr(self.transfer.instance_layout)
        return f"{part}|{hashlib.blake2b(layout.encode(), digest_size=8).hexdigest()}"

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- the loop body --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = [self._finish_output(rid, "abort") for rid in self._drain_aborted()]
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.decoding(), FUSED_MAX_ROWS)
        if self.disk is not None:
            self.disk.before_schedule()  # stored prefixes become cached blocks
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            self.idle()
            return outputs
        sampled_chunks = [c for c in scheduled.chunks if c.needs_sample]
        rows = self._sampling_rows(sampled_chunks, torch.device(self.config.device))
        added, self._added = self._added, []
        removed, self._removed = self._removed, []
        traced, self._traced = self._traced, {}
        started_ns = time.time_ns()
        result = self.executor.step(scheduled, rows, added, removed, traced)
        ended_ns = time.time_ns()
        self.tracer.step(scheduled.chunks, started_ns, ended_ns)
        self._observe_cost(scheduled, (ended_ns - started_ns) / 1e9)
        sampled = self._kept(sampled_chunks, result.token_ids, result.logprobs)
        self._advance_constraints(sampled)
        finished = {r.request_id for r in self.scheduler.update(scheduled, sampled)}
        if self.disk is not None:
            self.disk.after_update()  # new prompt blocks, copied before anything reuses them
        for request_id in sampled:
            output = self._emit(request_id, request_id in finished)
            if output is not None:
                outputs.append(output)
        return outputs

    def idle(self) -> None:
        """Call while nothing is scheduled: a parallel instance keeps its ranks' waits alive
        (and tells the sampling rank which requests are gone)."""
        if self.config.parallel is not None:
            removed, self._removed = self._removed, []
            self.executor.idle(removed)

    def weight_bytes(self) -> int:
        """The model's weights, and its draft model's."""
        draft = self.draft.loaded.weight_bytes if self.draft is not None else 0
        return self.loaded.weight_bytes + draft

    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.loaded, self.config.block_size)

    def grant_kv_blocks(self, num_blocks: int) -> None:
        self.scheduler.pool.set_grant(num_blocks)

    def release_kv_blocks(self, keep_blocks: int) -> int:
        released = self.scheduler.pool.release_free_tail(keep_blocks)
        if released:  # their pages go back to the system; touched afresh when needed
            size = self.config.block_size
            release_slots(self.runner.block_tensors(), released.start * size,
                          released.stop * size)
        return len(released)

    def close(self) -> None:
        """Release the engine's group (the other ranks of a parallel instance stop) and
        write out the disk tier's queue."""
        if self.disk is not None:
            self.disk.close()
        self.executor.shutdown()

    def stats(self) -> dict:
        return {
            "model": self.model_id,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            **self.scheduler.stats(),
            **(self.disk.stats() if self.disk is not None else {}),
        }

    # ---- helpers --------------------------------------------------------------------------

    def _drain_aborted(self) -> list[str]:
        aborted, self._aborted = self._aborted, []
        return [rid for rid in aborted if rid in self._requests]

    def _sampling_rows(self, chunks: list[ScheduledChunk],
                       device: torch.device) -> list[SamplingRow]:
        """One row per logits row: a chunk with drafts gets one per position it verifies,
        each seeing the drafts before it as output (penalties count them)."""
        request_ids = [c.request_id for c in chunks]
        constrained = [rid for rid in request_ids if self._states[rid].constraint is not None]
        masks: dict[str, torch.Tensor] = {}
        if constrained:  # unconstrained batches never get here
            allowed = self.grammars.allowed_tokens(
                [self._states[rid].constraint for rid in constrained]).to(device)  # [C, V]
            masks = dict(zip(constrained, allowed))
        rows = []
        for chunk in chunks:
            request = self._requests[chunk.request_id]
            drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_drafts:]
            for guessed in range(chunk.num_drafts + 1):
                outputs = request.output_token_ids
                if guessed:
                    outputs = outputs + list(drafts[:guessed])
                rows.append(SamplingRow(params=request.params,
                                        prompt_token_ids=request.prompt_token_ids,
                                        output_token_ids=outputs,
                                        generator=position_generator(
                                            request.params.seed, len(outputs), device),
                                        allowed_tokens=masks.get(chunk.request_id)))
        return rows

    def _kept(self, chunks: list[ScheduledChunk], samples: list[int],
              logprobs: list) -> dict[str, list[int]]:
        """Per sampled chunk, the tokens it adds (verify.py), their logprobs queued."""
        kept: dict[str, list[int]] = {}
        row = 0
        for chunk in chunks:
            count = chunk.num_logits
            tokens = [samples[row]]
            if chunk.num_drafts:
                drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_drafts:]
                tokens = kept_tokens(drafts, samples[row:row + count])
                self.speculator.record(chunk.request_id, chunk.num_drafts, len(tokens) - 1)
            state = self._states[chunk.request_id]
            for lp in logprobs[row:row + len(tokens)]:
                if lp is not None:
                    state.pending_logprobs.append(self._to_logprob(lp))
            kept[chunk.request_id] = tokens
            row += count
        return kept

    def _advance_constraints(self, sampled: dict[str, list[int]]) -> None:
        for request_id, token_ids in sampled.items():
            constraint = self._states[request_id].constraint
            for token_id in token_ids if constraint is not None else ():
                if not constraint.advance(token_id):
                    # Cannot happen for a masked token; the request then ends as complete.
                    log.error("request %s: grammar rejected token %d: %s", request_id,
                              token_id, constraint.error)
                    break

    def _observe_cost(self, scheduled, seconds: float) -> None:
        """A step of one generated token (with or without guesses) prices guessing."""
        chunks = scheduled.chunks
        if self.speculator is not None and len(chunks) == 1 and chunks[0].needs_sample \
                and not chunks[0].prompt:
            self.speculator.observe_step(chunks[0].num_drafts, seconds)

    def _forget_guesses(self, request_id: str) -> None:
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def _to_logprob(self, sampled) -> TokenLogprob:
        text = self.tokenizer.token_text
        return TokenLogprob(
            token_id=sampled.token_id, token=text(sampled.token_id), logprob=sampled.logprob,
            top=tuple(TopLogprob(token_id=t, token=text(t), logprob=lp) for t, lp in sampled.top),
        )

    def _emit(self, request_id: str, finished: bool) -> RequestOutput | None:
        """Detokenize the request's new tokens and apply stop strings."""
        request = self._requests[request_id]
        state = self._states[request_id]
        new_ids = request.output_token_ids[state.reported_tokens:]
        state.reported_tokens = len(request.output_token_ids)
        text, stopped = state.text_of(new_ids, self.tokenizer.eos_token_ids,
                                      request.params.ignore_eos)
        if not stopped and not finished and state.constraint is not None \
                and state.constraint.is_complete:
            finished = True  # the grammar admits nothing more: the output is whole
            self.scheduler.finish(request_id, "stop")
        if stopped and not finished:
            self.scheduler.finish(request_id, "stop")
        if stopped or finished:
            if not stopped:
                text += state.tail()
            reason: FinishReason = "stop" if stopped else (request.finish_reason or "stop")
            return self._finish_output(request_id, reason, text, tuple(new_ids))
        logprobs, state.pending_logprobs = tuple(state.pending_logprobs), []
        if not text and not new_ids:
            return None
        return RequestOutput(request_id=request_id, text=text, token_ids=tuple(new_ids),
                             finished=False, logprobs=logprobs, **self._usage(request))

    def _finish_output(self, request_id: str, reason: FinishReason, text: str = "",
                       token_ids: tuple[int, ...] = ()) -> RequestOutput:
        request = self._requests.pop(request_id)
        state = self._states.pop(request_id)
        self._forget_guesses(request_id)
        self.tracer.end(request_id)
        if self.config.parallel is not None:
            self._removed.append(request_id)
        return RequestOutput(request_id=request_id, text=text, token_ids=token_ids,
                             finished=True, finish_reason=reason,
                             logprobs=tuple(state.pending_logprobs),
                             stop_string=state.stop_checker.stop_string, **self._usage(request))

    @staticmethod
    def _usage(request: Request) -> dict:
        return {"prompt_tokens": len(request.prompt_token_ids),
                "completion_tokens": len(request.output_token_ids),
                "cached_tokens": request.num_cached_tokens,
                "draft_tokens": request.num_draft_tokens,
                "accepted_draft_tokens": request.num_accepted_tokens}

