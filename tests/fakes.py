"""A fake engine that implements EngineCore (shoal.engine.core) as a generating Engine
would, without torch.

Behaviour is steered by the model id (load) and by markers in the prompt (step):
  model ids:  fake-fail-load (raises UnsupportedModel), fake-exit-on-load (os._exit),
              fake-slow-load (takes ~1 s with progress)
  prompt:     RAISE (step raises once), KILLME (the runner SIGKILLs itself),
              FOREVER (ignores the natural stop), SLOW (0.2 s per step),
              TOOLCALL (writes the text "Let me check." and a tagged get_weather call,
              TOOL_CALL_PIECES, then stops)
Otherwise each step yields one token "w<i> " per request and a request stops after 8 tokens.

A model id starting "fake-harmony" has a tokenizer that speaks harmony (gpt-oss's chat
format, rendered by shoal since it carries no template) and replies with a scripted harmony
reply, one piece per step with special tokens split across pieces (HARMONY_REPLIES):
THINK (reasoning, then an answer), THINKCALL (reasoning, then a get_weather call), and,
once the conversation holds a tool result, AFTERCALL (reasoning, then the answer). Special
tokens are dropped from the text unless the request keeps them (skip_special_tokens).
A model id starting "fake-think" has a chat template that mentions </think> (as Qwen3's) and
writes the same scripts with its reasoning between <think> tags (THINK_REPLIES); with
enable_thinking false it answers at once.
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from shoal.engine.core import NoEmbedding, NotFollower
from shoal.engine.errors import UnsupportedModel, check_context
from shoal.engine.outputs import RequestOutput, TokenLogprob, TopLogprob
from shoal.engine.sampling import InvalidParameter
from shoal.engine.tokenizer.chat_template import CHATML_TEMPLATE, ChatTemplate

VOCAB_SIZE = 1000
MAX_MODEL_LEN = 128
HARMONY_MAX_MODEL_LEN = 4096
NATURAL_LENGTH = 8
# What a TOOLCALL request writes, one piece per step (the tag is split across pieces).
TOOL_CALL_PIECES = ("Let me check. <tool", '_call>\n{"name": "get_weather", ',
                    '"arguments": {"city": "Paris"}}\n</tool', "_call>")
HARMONY_REPLIES = {
    "THINK": ("<|channel|>analysis<|mess", "age|>The user greets me. ", "Reply kindly.<|end|>",
              "<|start|>assistant<|chan", "nel|>final<|message|>Hello", " there!"),
    "THINKCALL": ("<|channel|>analysis<|message|>Need the weather", " in Paris.<|end|><|sta",
                  "rt|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json",
                  '<|message|>{"city": ', '"Paris"}'),
    "AFTERCALL": ("<|channel|>analysis<|message|>It is sunny there.<|end|>",
                  "<|start|>assistant<|channel|>final<|message|>Sunny in Paris, ", "22 C."),
}
THINK_REPLIES = {
    "THINK": ("<think>\nThe user greets me.", " Reply kindly.\n</th", "ink>\n\nHello",
              " there!"),
    "THINKCALL": ("<think>\nNeed the weather", " in Paris.\n</think>\n\n<tool_call>\n",
                  '{"name": "get_weather", "arguments": {"city": "Paris"}}', "\n</tool_call>"),
    "AFTERCALL": ("<think>\nIt is sunny there.\n</think>\n\n", "Sunny in Paris, ", "22 C."),
    "NOTHINK": ("Hello", " there!"),
}
# Mentions </think> and enable_thinking as Qwen3's template does; renders ChatML.
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                  "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and not enable_thinking %}"
                  "<think>\n\n</think>\n\n{% endif %}")
_SPECIAL_TOKEN = re.compile(r"<\|[a-z]+\|>")


class FakeTokenizer:
    has_chat_template = True
    speaks_harmony = False
    eos_token_ids = frozenset({1})
    chat_template = ChatTemplate(CHATML_TEMPLATE)  # no tool support: tools go in a system turn

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # one token per whitespace-separated word; markers survive as their own words
        return [10 + (sum(map(ord, word)) % (VOCAB_SIZE - 10)) for word in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(f"w{i}" for i in ids)

    def token_text(self, token_id: int) -> str:
        return f"w{token_id} "


class FakeThinkTokenizer(FakeTokenizer):
    """A chat template whose model reasons between <think> tags."""

    chat_template = ChatTemplate(THINK_TEMPLATE)


class FakeHarmonyTokenizer(FakeTokenizer):
    """A vocabulary with harmony's special tokens and no chat template of its own."""

    has_chat_template = False
    speaks_harmony = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # special tokens are words of their own, so markers next to them are still found
        return super().encode(_SPECIAL_TOKEN.sub(lambda m: f" {m.group(0)} ", text))


@dataclass
class _FakeRequest:
    prompt_ids: list[int]
    params: object
    markers: set[str]
    script: tuple[str, ...] | None = None  # the pieces it writes, one per step
    generated: list[int] = field(default_factory=list)
    text: str = ""


class FakeEngine(NoEmbedding, NotFollower):
    task = "generate"
    tracer = None
    speculator = None

    def __init__(self, config, progress=None) -> None:
        report = progress or (lambda stage, fraction: None)
        model_id = config.source.model_id
        if model_id == "fake-fail-load":
            raise UnsupportedModel("fake architecture 'nope' is not supported")
        if model_id == "fake-exit-on-load":
            os._exit(1)
        if model_id == "fake-slow-load":
            for i in range(5):
                report("weights", i / 5)
                time.sleep(0.2)
        report("ready", 1.0)
        self.config = config
        self.model_id = model_id
        harmony = model_id.startswith("fake-harmony")
        self.tokenizer = FakeHarmonyTokenizer() if harmony else \
            FakeThinkTokenizer() if model_id.startswith("fake-think") else FakeTokenizer()
        # Anthropic's thinking needs max_tokens above a 1,024-token budget.
        self.max_model_len = HARMONY_MAX_MODEL_LEN if harmony else MAX_MODEL_LEN
        self.vocab_size = VOCAB_SIZE
        self.words: dict[int, str] = {}
        self._requests: dict[str, _FakeRequest] = {}
        self._aborted: list[str] = []
        self.raised = False
        self.priorities: dict[str, int] = {}  # request id -> the priority it was added with

    def render_chat(self, messages, tools=None, variables=None) -> str:
        text = " ".join(f"{m['role']}: {m['content']}" for m in messages) + " assistant:"
        if (variables or {}).get("enable_thinking") is False:
            text += " NOTHINK"  # the template closed an empty <think> block
        return text

    def add_request(self, request_id, prompt_token_ids, params, grammar=None,
                    priority=0, trace=None) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        params.check_vocab(self.vocab_size)
        check_context(len(prompt_token_ids), params.max_tokens, self.max_model_len)
        markers = {name for name in ("RAISE", "KILLME", "FOREVER", "SLOW", "TOOLCALL",
                                     "THINK", "THINKCALL", "NOTHINK", "to=assistant",
                                     "<tool_response>")
                   if self.tokenizer.encode(name)[0] in prompt_token_ids}
        self._requests[request_id] = _FakeRequest(list(prompt_token_ids), params, markers,
                                                  self._script(markers))
        self.priorities[request_id] = priority

    def _script(self, markers: set[str]) -> tuple[str, ...] | None:
        if "TOOLCALL" in markers:
            return TOOL_CALL_PIECES
        if self.tokenizer.speaks_harmony:
            replies, after_call = HARMONY_REPLIES, "to=assistant"
        elif isinstance(self.tokenizer, FakeThinkTokenizer):
            replies, after_call = THINK_REPLIES, "<tool_response>"
        else:
            return None
        if "NOTHINK" in markers and "NOTHINK" in replies:
            return replies["NOTHINK"]
        if after_call in markers:  # a tool result is in the conversation
            return replies["AFTERCALL"]
        for name in ("THINKCALL", "THINK"):
            if name in markers:
                return replies[name]
        return None

    def abort_request(self, request_id) -> None:
        if request_id in self._requests:
            self._aborted.append(request_id)
            log_path = os.environ.get("SHOAL_FAKE_ABORT_LOG")
            if log_path:  # lets tests see that a cancel reached the engine
                with open(log_path, "a") as log:
                    log.write(request_id + "\n")

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def stats(self) -> dict:
        return {"num_running": len(self._requests), "num_waiting": 0}

    def idle(self) -> None:
        pass

    def prefix_pool(self):
        return None  # no prefix cache to share

    def kv_layout_key(self) -> str:
        return ""

    def export_prefix(self, token_ids, max_blocks=None):
        return None

    def import_prefix(self, blocks) -> int:
        return 0

    def weight_bytes(self):
        return None  # cannot tell

    def kv_bytes_per_block(self):
        return None  # no KV cache

    def grant_kv_blocks(self, num_blocks: int) -> None:
        self.kv_grant = num_blocks

    def release_kv_blocks(self, keep_blocks: int) -> int:
        return 0

    def close(self) -> None:
        pass

    def step(self) -> list[RequestOutput]:
        outputs = [self._finish(rid, "abort", "", ()) for rid in self._aborted
                   if rid in self._requests]
        self._aborted = []
        for request in self._requests.values():
            if "RAISE" in request.markers and not self.raised:
                self.raised = True
                raise RuntimeError("fake engine step failure")
            if "KILLME" in request.markers:
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.2 if any("SLOW" in r.markers for r in self._requests.values()) else 0.005)
        for request_id in list(self._requests):
            outputs.append(self._advance(request_id))
        return outputs

    def _advance(self, request_id: str) -> RequestOutput:
        request = self._requests[request_id]
        token = 100 + len(request.generated)
        request.generated.append(token)
        piece = f"w{len(request.generated)} "
        if request.script is not None:
            piece = request.script[len(request.generated) - 1]
            if request.params.skip_special_tokens:
                piece = _SPECIAL_TOKEN.sub("", piece)
        request.text += piece
        params = request.params
        logprobs = ()
        if params.logprobs:
            top = tuple(TopLogprob(token_id=token + k, token=f"w{token + k} ",
                                   logprob=math.log(0.5 / (k + 1))) for k in range(params.top_logprobs))
            logprobs = (TokenLogprob(token_id=token, token=piece, logprob=math.log(0.5), top=top),)
        for stop in params.stop:
            if stop in request.text:
                cut = request.text.index(stop)
                start = len(request.text) - len(piece)
                visible = request.text[start:cut] if cut > start else ""
                return self._finish(request_id, "stop", visible, (token,), logprobs,
                                    stop_string=stop)
        count = len(request.generated)
        if params.max_tokens is not None and count >= params.max_tokens:
            return self._finish(request_id, "length", piece, (token,), logprobs)
        if request.script is not None and count == len(request.script):
            return self._finish(request_id, "stop", piece, (token,), logprobs)
        if count >= NATURAL_LENGTH and "FOREVER" not in request.markers:
            return self._finish(request_id, "stop", piece, (token,), logprobs)
        if len(request.prompt_ids) + count >= self.max_model_len:
            return self._finish(request_id, "length", piece, (token,), logprobs)
        return RequestOutput(request_id=request_id, text=piece, token_ids=(token,), finished=False,
                             logprobs=logprobs, prompt_tokens=len(request.prompt_ids),
                             completion_tokens=count)

    def _finish(self, request_id, reason, text, token_ids, logprobs=(),
                stop_string=None) -> RequestOutput:
        request = self._requests.pop(request_id)
        return RequestOutput(request_id=request_id, text=text, token_ids=tuple(token_ids),
                             finished=True, finish_reason=reason, logprobs=logprobs,
                             prompt_tokens=len(request.prompt_ids),
                             completion_tokens=len(request.generated), stop_string=stop_string)


def make_fake_engine(config, progress=None) -> FakeEngine:
    return FakeEngine(config, progress)


# FakeKVEngine's shape: a KV block is 2 (K, V) * 2 layers * 2 heads * 8 dims * 4 bytes * 4 slots.
KV_BLOCK_SIZE = 4
KV_NUM_BLOCKS = 64
KV_BYTES_PER_BLOCK = 2 * 2 * 2 * 8 * 4 * KV_BLOCK_SIZE
WEIGHT_BYTES = 5000


class FakeKVEngine(FakeEngine):
    """FakeEngine with what the runner reads for its memory report, as the real Engine has
    it: the weights held, the bytes of a KV block (sized by the engine's own rule from a
    model shape and cache dtype), and stats() with the blocks in use (each request holds
    its tokens' blocks). Measuring it imports torch (kv_bytes_per_token), so only memory
    tests use it."""

    def __init__(self, config, progress=None) -> None:
        super().__init__(config, progress)
        # A key and a value row per KV head (ModelConfig.kv_cache_rows / kv_row_dim).
        shape = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8, kv_cache_rows=4,
                                kv_row_dim=8)
        self.loaded = SimpleNamespace(weight_bytes=WEIGHT_BYTES, config=shape,
                                      cache_dtype="float32", layer_range=(0, 2))

    def weight_bytes(self) -> int:
        return self.loaded.weight_bytes

    def kv_bytes_per_block(self) -> int:
        from shoal.engine.kv_budget import kv_bytes_per_block  # imports torch

        return kv_bytes_per_block(self.loaded, KV_BLOCK_SIZE)

    def stats(self) -> dict:
        used = sum(-(-(len(r.prompt_ids) + len(r.generated)) // KV_BLOCK_SIZE)
                   for r in self._requests.values())
        return {**super().stats(), "kv_blocks_used": used, "kv_blocks_total": KV_NUM_BLOCKS}


def make_fake_kv_engine(config, progress=None) -> FakeKVEngine:
    return FakeKVEngine(config, progress)


GRANT_NUM_BLOCKS = 1024  # a FakeGrantEngine's capacity: four grant steps


class FakeGrantEngine(FakeKVEngine):
    """FakeKVEngine whose KV pool is bounded by the node's grant, as the real Engine's:
    stats() reports the blocks granted and grant_kv_blocks() moves the bound."""

    def __init__(self, config, progress=None) -> None:
        super().__init__(config, progress)
        self.kv_grant = GRANT_NUM_BLOCKS
        self.max_model_len = GRANT_NUM_BLOCKS * KV_BLOCK_SIZE  # prompts long enough to grow

    def grant_kv_blocks(self, num_blocks: int) -> None:
        self.kv_grant = min(num_blocks, GRANT_NUM_BLOCKS)

    def release_kv_blocks(self, keep_blocks: int) -> int:
        before = self.kv_grant
        self.kv_grant = max(keep_blocks, super().stats()["kv_blocks_used"])
        return max(0, before - self.kv_grant)

    def stats(self) -> dict:
        return {**super().stats(), "kv_blocks_total": GRANT_NUM_BLOCKS,
                "kv_blocks_granted": self.kv_grant}


def make_fake_grant_engine(config, progress=None) -> FakeGrantEngine:
    return FakeGrantEngine(config, progress)


# ---- helpers for tests that spawn runners with the fake engine ----------------------------

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
FAKE_RUNNER = os.path.join(TESTS_DIR, "fake_runner.py")


def fake_runner_env() -> dict[str, str]:
    """Environment that lets a runner subprocess import this module."""
    existing = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": TESTS_DIR + (os.pathsep + existing if existing else "")}


def write_fake_gguf(path) -> None:
    """A GGUF file with a llama header and no tensors: enough for placement to read the
    model's facts (shoal.cluster.model_facts); the fake engine never reads it."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_context_length(MAX_MODEL_LEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def fake_engine_config(tmp_dir, model_id: str = "fake-model"):
    from pathlib import Path

    from shoal.engine.config import EngineConfig, ModelSource

    weights = Path(tmp_dir) / f"{model_id}.gguf"
    if not weights.exists():
        write_fake_gguf(weights)
    return EngineConfig(source=ModelSource(model_id=model_id, format="gguf", path=weights))


def fake_supervisor_options(fake_engine: str = "text", **overrides):
    """Options whose runners serve a fake engine (tests/fake_runner.py): "text" (FakeEngine),
    "kv" (FakeKVEngine), "grant" (FakeGrantEngine) or "embedding" (FakeEmbeddingEngine for
    task "embed", else text)."""
    from shoal.runner.options import SupervisorOptions

    values = dict(runner_command=(sys.executable, FAKE_RUNNER, "--fake-engine", fake_engine),
                  env=fake_runner_env(),
                  load_timeout_s=30.0, ready_wait_s=10.0, chunk_timeout_s=10.0,
                  restart_backoff_s=(0.1, 0.2, 0.3), shutdown_grace_s=2.0)
    values.update(overrides)
    return SupervisorOptions(**values)


# ---- an in-process router for API adapter tests --------------------------------------------

class ScriptedRouter:
    """Stands in for shoal.router.Router in API tests that need no runner: records every
    GenerationRequest it is given and answers with the chunks script(request) returns
    (AcceptedChunk first). The default script says "hello world" and stops."""

    def __init__(self, script=None) -> None:
        from shoal.metrics import NodeMetrics
        from shoal.pool.queue import AdmissionQueue
        from shoal.tracing.spans import SpanBuffer

        self.requests = []
        self.supervisors = []
        self.script = script or (lambda request: scripted_reply(request, ["hello", " world"]))
        self.metrics = NodeMetrics()
        self.spans = SpanBuffer()
        self.queue = AdmissionQueue()  # stays empty: nothing waits for a turn here

    async def submit(self, request):
        self.requests.append(request)
        for chunk in self.script(request):
            yield chunk

    def cancel(self, request_id: str) -> bool:
        return False  # a scripted request is over before anyone could cancel it

    def canonical_id(self, name: str) -> str:
        return name


def scripted_reply(request, pieces, tool_calls=(), finish_reason=None, prompt_tokens=5,
                   stop_sequence=None):
    """Accepted, one TokenChunk per piece, one ToolCallChunk per (name, arguments JSON), Finish."""
    from shoal.protocol import (
        AcceptedChunk,
        FinishChunk,
        TokenChunk,
        ToolCall,
        ToolCallChunk,
        Usage,
    )

    rid = request.request_id
    chunks = [AcceptedChunk(request_id=rid, prompt_tokens=prompt_tokens)]
    chunks += [TokenChunk(request_id=rid, text=piece, token_ids=(100 + i,))
               for i, piece in enumerate(pieces)]
    chunks += [ToolCallChunk(request_id=rid, index=i,
                             call=ToolCall(id=f"call_{i}", name=name, arguments=arguments))
               for i, (name, arguments) in enumerate(tool_calls)]
    reason = finish_reason or ("tool_calls" if tool_calls else "stop")
    chunks.append(FinishChunk(request_id=rid, finish_reason=reason, stop_sequence=stop_sequence,
                              usage=Usage(prompt_tokens=prompt_tokens,
                                          completion_tokens=len(pieces) + len(tool_calls))))
    return chunks


class FakeClock:
    """A clock tests move by hand: clock() is `now`."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
