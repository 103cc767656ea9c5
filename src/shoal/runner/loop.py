"""RunnerLoop: take the supervisor's messages, step the engine, stream chunks back."""

from __future__ import annotations

import logging
import traceback
from typing import Any

from pydantic import ValidationError

from shoal.engine.core import EngineCore, PromptTokenizer
from shoal.engine.errors import ContextLengthExceeded, GroupError
from shoal.engine.grammar_spec import InvalidGrammar
from shoal.engine.outputs import RequestOutput, TokenLogprob
from shoal.engine.sampling import InvalidParameter
from shoal.protocol import (
    AcceptedChunk,
    EmbeddingRequest,
    EmbeddingResult,
    ErrorChunk,
    FinishChunk,
    GenerationRequest,
    LogprobItem,
    ReasoningChunk,
    TokenChunk,
    ToolCallChunk,
    TopLogprobItem,
    TraceRef,
    Usage,
)
from shoal.runner.channel import EOF, Channel, SupervisorGone
from shoal.runner.framing import FrameTooLarge
from shoal.runner.kv_grant import KVGrantKeeper
from shoal.runner.memory import MemoryReporter, return_freed_heap
from shoal.runner.messages import (
    Cancel,
    ChunkBatch,
    ChunkMessage,
    Embed,
    GrantKV,
    Shutdown,
    Submit,
    parse_to_runner,
)
from shoal.runner.prefix_messages import PrefixExport, PrefixFetched, PrefixPart
from shoal.runner.prefix_share import RunnerPrefixShare
from shoal.runner.chat_format import (
    ChatFormat,
    OutputStream,
    TemplateChat,
    check_reasoning,
    choose_chat_format,
)
from shoal.runner.tool_stream import IndexedCall, ReasoningPiece
from shoal.runner.tool_use import check_tools, grammar_param
from shoal.tracing.steps import RequestTrace

log = logging.getLogger("shoal.runner")


def request_trace(trace: TraceRef | None) -> RequestTrace | None:
    return None if trace is None else RequestTrace(trace.trace_id, trace.span_id)


def _logprob_items(logprobs: tuple[TokenLogprob, ...]) -> tuple[LogprobItem, ...]:
    return tuple(
        LogprobItem(token_id=lp.token_id, token=lp.token, logprob=lp.logprob,
                    top=tuple(TopLogprobItem(token_id=t.token_id, token=t.token,
                                             logprob=t.logprob) for t in lp.top))
        for lp in logprobs)


class RunnerLoop:
    """Serves Submit/Cancel against one engine until Shutdown or the socket closes."""

    def __init__(self, engine: EngineCore, channel: Channel,
                 memory: MemoryReporter | None = None,
                 kv_grant: KVGrantKeeper | None = None) -> None:
        if engine.tokenizer is None:
            raise ValueError("a follower rank serves its rank 0's plans, not requests")
        self.engine = engine
        self.tokenizer: PromptTokenizer = engine.tokenizer
        self.channel = channel
        self.memory = memory  # reports what the runner holds, between steps
        self.kv_grant = kv_grant  # asks the node before the KV cache outgrows its grant
        self.in_flight: set[str] = set()
        self.embeds = engine.task == "embed"
        # Requests whose text is read: tool calls taken out, reasoning split from the answer.
        self.output_streams: dict[str, OutputStream] = {}
        self._chat_format: ChatFormat | None = None
        self._raw_format: TemplateChat | None = None
        self._outbox: list[Any] | None = None  # chunks of the step being reported
        self._stepped = False  # steps ran since the heap was last trimmed
        # Prefix KV between nodes (None: an engine without a prefix cache to share).
        self.share = None if self.embeds else RunnerPrefixShare.for_engine(engine, channel.send)

    def run(self) -> None:
        # Rank 0 of a parallel instance wakes while idle to keep its ranks' waits alive.
        parallel = self.engine.config.parallel
        tick_s = parallel.keepalive_s / 2 if parallel is not None else None
        while True:
            # Requests that wait only for a grant the node refused: wait for a message
            # (the grant, a cancel) or the next ask rather than spin on empty steps.
            starved = self.kv_grant is not None and self.kv_grant.starved
            block = starved or not self.has_work()
            for raw in self.channel.receive(block, self._wait_s(tick_s, starved)):
                if not self.handle(raw):
                    return
            if self.share is not None:
                for held in self.share.overdue():
                    self._admit(held.request, held.token_ids)
                self.share.maybe_report()
            if self.has_work():
                self.step()
                if self.kv_grant is not None:
                    self.kv_grant.busy()
                    self.kv_grant.maybe_ask()
            else:
                self.rest(keepalive=tick_s is not None)
                if self.kv_grant is not None:
                    self.kv_grant.rest()
            if self.memory is not None:
                self.memory.maybe_report()

    def _wait_s(self, tick_s: float | None, starved: bool = False) -> float | None:
        """How long an idle loop may wait for a message: until the next keep-alive, memory
        check, ask for KV or release of it, whichever comes first (None: until a message
        comes)."""
        waits = [tick_s, self.memory.seconds_until_due() if self.memory else None,
                 self.share.wait_s() if self.share is not None else None,
                 self.kv_grant.seconds_until_due() if starved and self.kv_grant else None,
                 self.kv_grant.seconds_until_release() if self.kv_grant else None]
        waits = [w for w in waits if w is not None]
        return min(waits) if waits else None

    def rest(self, keepalive: bool) -> None:
        """Nothing to step: after a burst of steps, hand their freed buffers back to the
        system (once); a parallel instance's rank 0 also keeps its ranks' waits alive."""
        if self._stepped:
            return_freed_heap()
            self._stepped = False
        if keepalive:
            self.idle()

    def idle(self) -> None:
        try:
            self.engine.idle()
        except Exception as error:
            raise EngineBroken(f"the instance lost a rank: {error}") from error

    def has_work(self) -> bool:
        # An embedding engine answers each request at once; it never has work left over.
        return self.engine.has_unfinished_requests()

    def handle(self, raw: Any) -> bool:
        """Apply one incoming message; False means stop serving."""
        if raw is EOF:
            raise SupervisorGone()
        try:
            message = parse_to_runner(raw)
        except ValidationError as error:
            self._reject_unparsable(raw, error)
            return True
        if isinstance(message, Submit):
            self.submit(message.request)
        elif isinstance(message, Embed):
            self.embed(message.request)
        elif isinstance(message, Cancel):
            if self.share is not None and self.share.cancel(message.request_id):
                return True  # held for its prefix: never reached the engine nor was accepted
            self.engine.abort_request(message.request_id)  # embeddings: already answered
        elif self.share is not None and isinstance(message, PrefixPart):
            self.share.on_part(message)
        elif self.share is not None and isinstance(message, PrefixFetched):
            held = self.share.on_fetched(message)
            if held is not None:
                self._admit(held.request, held.token_ids)
        elif self.share is not None and isinstance(message, PrefixExport):
            self.share.export(message)
        elif isinstance(message, GrantKV):
            if self.kv_grant is not None:
                self.kv_grant.on_grant(message)
        elif isinstance(message, Shutdown):
            return False
        else:
            log.warning("ignoring %s after the engine is loaded", message.type)
        return True

    def _reject_unparsable(self, raw: Any, error: ValidationError) -> None:
        request = raw.get("request") if isinstance(raw, dict) else None
        request_id = request.get("request_id") if isinstance(request, dict) else None
        log.error("unparsable message from the supervisor: %s", error)
        if isinstance(request_id, str):
            self.send_chunk(ErrorChunk(request_id=request_id, code="invalid_request",
                                       message=f"malformed request: {error}"))

    # ---- submit ---------------------------------------------------------------------------

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        tokenizer = self.tokenizer
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
            if bad:
                raise InvalidParameter("prompt", f"token id {bad[0]} is outside the "
                                                  f"vocabulary (size {self.engine.vocab_size})")
            return ids
        if request.messages is not None:
            return tokenizer.encode(self.chat_format.prompt(request), add_special_tokens=True)
        if request.prompt is not None:
            return tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        raise InvalidParameter("prompt", "one of prompt, messages or prompt_token_ids is needed")

    def submit(self, request: GenerationRequest) -> None:
        if self.embeds:
            self._error(request.request_id, "invalid_request", f"model "
                        f"{self.engine.model_id!r} is an embedding model; it cannot generate "
                        f"text", "model")
            return
        self._admit(request)

    def _admit(self, request: GenerationRequest, ids: list[int] | None = None) -> None:
        """Tokenize (unless ids are given: a request held for its prefix blocks) and queue
        the request, or answer why not."""
        request_id = request.request_id
        try:
            if ids is None:
                check_tools(request)
                check_reasoning(request, self.chat_format, self.engine.model_id)
                ids = self.prompt_token_ids(request)
                if (not request.count_only and self.share is not None
                        and self.share.hold(request, ids)):
                    return  # admitted when its fetch ends, within the share's bound
            if not request.count_only:
                grammar, sampling = self.format_for(request).output_rules(request)
                self.engine.add_request(request_id, ids, sampling, grammar=grammar,
                                        priority=request.priority,
                                        trace=request_trace(request.trace))
                if self.share is not None:
                    self.share.admitted(request, ids)
        except InvalidGrammar as error:
            param = grammar_param(request)
            self._error(request_id, "invalid_request",
                        f"{param}: the schema cannot be enforced: {error}", param)
        except InvalidParameter as error:
            self._error(request_id, "invalid_request", str(error), error.param)
        except ContextLengthExceeded as error:
            self._error(request_id, "context_length_exceeded", str(error), "messages"
                        if request.messages is not None else "prompt")
        except ValueError as error:  # a duplicate id, a template that rejects the messages
            self._error(request_id, "invalid_request", str(error))
        except Exception as error:  # noqa: BLE001 - a bug must not take the runner down
            log.error("submit %s failed:\n%s", request_id, traceback.format_exc())
            self._error(request_id, "internal", f"{type(error).__name__}: {error}")
        else:
            if request.count_only:
                self.send_chunk(AcceptedChunk(request_id=request_id, prompt_tokens=len(ids)))
                self.send_chunk(FinishChunk(request_id=request_id, finish_reason="stop",
                                            usage=Usage(prompt_tokens=len(ids),
                                                        completion_tokens=0)))
                return
            self.in_flight.add(request_id)
            stream = self.format_for(request).output_stream(request)
            if stream is not None:
                self.output_streams[request_id] = stream
            self.send_chunk(AcceptedChunk(request_id=request_id, prompt_tokens=len(ids)))

    @property
    def chat_format(self) -> ChatFormat:
        """How this model's chats are written and read (a raw prompt: see format_for)."""
        if self._chat_format is None:
            self._chat_format = choose_chat_format(self.tokenizer, self.engine.render_chat)
        return self._chat_format

    def format_for(self, request: GenerationRequest) -> ChatFormat:
        """The chat format for a chat; a raw prompt is generated as written, its output read
        only for tool calls."""
        if request.messages is not None:
            return self.chat_format
        if self._raw_format is None:
            self._raw_format = TemplateChat(self.tokenizer, self.engine.render_chat)
        return self._raw_format

    # ---- embed ----------------------------------------------------------------------------

    def embed(self, request: EmbeddingRequest) -> None:
        """Answer at once: one EmbeddingResult or ErrorChunk (the batch runs synchronously)."""
        request_id = request.request_id
        if not self.embeds:
            self._error(request_id, "invalid_request", f"model {self.engine.model_id!r} "
                        f"generates text; it does not produce embeddings", "model")
            return
        try:
            if request.texts is not None:
                ids = self.engine.tokenize(request.texts, request.truncate)
            else:
                ids = self.engine.check_token_ids(request.token_ids or (), request.truncate)
            vectors = self.engine.embed(ids) if ids else None  # [B, dimensions] float32
        except InvalidParameter as error:
            self._error(request_id, "invalid_request", str(error), error.param)
        except ContextLengthExceeded as error:
            self._error(request_id, "context_length_exceeded", str(error), "input")
        except Exception as error:  # noqa: BLE001 - a bug must not take the runner down
            log.error("embed %s failed:\n%s", request_id, traceback.format_exc())
            self._error(request_id, "internal", f"{type(error).__name__}: {error}")
        else:
            rows = () if vectors is None else tuple(map(tuple, vectors.tolist()))
            try:
                self.send_chunk(EmbeddingResult(request_id=request_id, embeddings=rows,
                                                prompt_tokens=sum(len(i) for i in ids)))
            except FrameTooLarge as error:  # raised before anything is written
                self._error(request_id, "invalid_request", f"the embeddings of this batch are "
                            f"too large to return ({error.size} bytes encoded, limit "
                            f"{error.limit}); send fewer inputs per request", "input")

    # ---- step -----------------------------------------------------------------------------

    def step(self) -> None:
        self._stepped = True
        try:
            outputs = self.engine.step()
        except Exception as error:  # noqa: BLE001 - fail the batch, keep serving
            log.error("engine step failed:\n%s", traceback.format_exc())
            if isinstance(error, GroupError):  # a rank of the instance is gone
                self._fail_in_flight(f"the model's instance lost a rank: {error}",
                                     code="unavailable")
            else:
                self._fail_in_flight(f"engine step failed: {type(error).__name__}: {error}")
            return
        self._outbox = []
        try:
            for output in outputs:
                self.send_output(output)
        finally:
            chunks, self._outbox = self._outbox, None
        if chunks:
            self._send_batch(chunks)

    def _send_batch(self, chunks: list[Any]) -> None:
        try:
            self.channel.send(ChunkBatch(chunks=tuple(chunks)))
        except FrameTooLarge:  # raised before anything is written
            for chunk in chunks:
                self.channel.send(ChunkMessage(chunk=chunk))

    def _fail_in_flight(self, message: str, code: str = "internal") -> None:
        failed, self.in_flight = sorted(self.in_flight), set()
        for request_id in failed:
            self._error(request_id, code, message)
            self.engine.abort_request(request_id)
        try:
            self.engine.step()  # reports the aborts; frees their KV blocks
        except Exception as error:
            raise EngineBroken(f"engine cannot recover after a failed step: {error}") from error
        if self.engine.has_unfinished_requests():
            raise EngineBroken("engine still holds requests after aborting all of them")

    def send_output(self, output: RequestOutput) -> None:
        request_id = output.request_id
        if request_id not in self.in_flight:
            self.output_streams.pop(request_id, None)
            return  # cancelled by the supervisor, or already failed
        stream = self.output_streams.get(request_id)
        if stream is not None:
            self._send_pieces(request_id, stream, output)
        elif output.text or output.token_ids:
            self.send_chunk(TokenChunk(request_id=request_id, text=output.text,
                                       token_ids=output.token_ids,
                                       logprobs=_logprob_items(output.logprobs)))
        if output.finished:
            self.in_flight.discard(request_id)
            finish_reason = output.finish_reason or "stop"
            reasoning_tokens = 0
            if stream is not None:
                finish_reason = stream.finish_reason(finish_reason)
                reasoning_tokens = stream.reasoning_tokens
                del self.output_streams[request_id]
            usage = Usage(prompt_tokens=output.prompt_tokens,
                          completion_tokens=output.completion_tokens,
                          cached_tokens=output.cached_tokens,
                          draft_tokens=output.draft_tokens,
                          accepted_draft_tokens=output.accepted_draft_tokens,
                          reasoning_tokens=reasoning_tokens)
            self.send_chunk(FinishChunk(request_id=request_id, finish_reason=finish_reason,
                                        usage=usage, stop_sequence=output.stop_string))

    def _send_pieces(self, request_id: str, stream: OutputStream,
                     output: RequestOutput) -> None:
        for piece in stream.feed(output):
            if isinstance(piece, IndexedCall):
                self.send_chunk(ToolCallChunk(request_id=request_id, index=piece.index,
                                              call=piece.call))
            elif isinstance(piece, ReasoningPiece):
                self.send_chunk(ReasoningChunk(request_id=request_id, text=piece.text,
                                               token_ids=piece.token_ids))
            else:
                self.send_chunk(TokenChunk(request_id=request_id, text=piece.text,
                                           token_ids=piece.token_ids,
                                           logprobs=_logprob_items(piece.logprobs)))

    def _error(self, request_id: str, code: str, message: str, param: str | None = None) -> None:
        self.send_chunk(ErrorChunk(request_id=request_id, code=code, message=message,
                                   param=param))

    def send_chunk(self, chunk: Any) -> None:
        if self._outbox is not None:  # inside step(): sent with the step's other chunks
            self._outbox.append(chunk)
        else:
            self.channel.send(ChunkMessage(chunk=chunk))


class EngineBroken(RuntimeError):
    """The engine's state is no longer trustworthy; the runner exits to be restarted."""
