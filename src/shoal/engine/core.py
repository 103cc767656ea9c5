"""EngineCore: everything the runner may use of an engine, the one seam between them.

Three kinds of engine implement it: Engine (generates text; also rank 0 of a split model),
EmbeddingEngine (texts -> vectors) and FollowerEngine (ranks 1 and up of a split model,
following rank 0's steps). Every kind has every member: what does not apply to it is a
neutral value from the mixins below (no requests, no vectors, nothing to follow), so the
runner picks its way of serving by `task` and `is_follower` and never probes the engine.

Importing this module loads no torch: the heavy types are named for type checkers only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from shoal.engine.config import EngineConfig
    from shoal.engine.grammar_spec import GrammarSpec
    from shoal.engine.kv.block_pool import BlockPool
    from shoal.engine.kv.transfer import PrefixBlocks
    from shoal.engine.outputs import RequestOutput
    from shoal.engine.sampling import SamplingParams
    from shoal.engine.speculation.speculator import Speculator
    from shoal.engine.tokenizer.chat_template import ChatTemplate
    from shoal.tracing.steps import RequestTrace, StepTracer

EngineTask = Literal["generate", "embed"]
ProgressCallback = Callable[[str, float], None]  # (stage, fraction done) while loading
EngineFactory = Callable[["EngineConfig", ProgressCallback], "EngineCore"]


class PromptTokenizer(Protocol):
    """What the runner reads of an engine's tokenizer: prompts to ids, the chat template."""

    has_chat_template: bool  # the checkpoint brings its own (else a family default)
    speaks_harmony: bool  # its vocabulary has harmony's special tokens (gpt-oss)

    @property
    def chat_template(self) -> ChatTemplate: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class Vectors(Protocol):
    """[B, dimensions] float32 embeddings (a torch tensor; a numpy array in tests)."""

    def tolist(self) -> list[list[float]]: ...


@runtime_checkable
class EngineCore(Protocol):
    """A loaded model the runner drives, synchronously, from one thread."""

    # ---- what it is -------------------------------------------------------------------
    task: EngineTask
    is_follower: bool  # a rank other than 0: it serves rank 0's plans through run()
    model_id: str
    max_model_len: int
    vocab_size: int
    config: EngineConfig
    tokenizer: PromptTokenizer | None  # None: a follower rank, which reads no text
    dimensions: int | None  # the length of an embedding; None when it does not embed
    tracer: StepTracer | None  # its request spans (GET /v1/traces/{id}); None: not traced
    speculator: Speculator | None  # its guesser; None: it never speculates

    # ---- generating text (task "generate", not a follower) ----------------------------
    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    variables: dict[str, Any] | None = None) -> str:
        """The chat template rendered; variables: extra template variables
        (reasoning_effort, enable_thinking)."""

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, grammar: GrammarSpec | None = None,
                    priority: int = 0, trace: RequestTrace | None = None) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def idle(self) -> None:
        """Called while nothing is scheduled (a split model keeps its ranks' waits alive)."""

    # ---- prefix KV shared between instances --------------------------------------------
    def prefix_pool(self) -> BlockPool | None:
        """The block pool whose prefix cache other instances may share; None: nothing to
        share (prefix caching off, an embedding model, a follower rank)."""

    def kv_layout_key(self) -> str:
        """How this instance's KV is split and laid out: what another instance's must
        equal for blocks to move between them."""

    def export_prefix(self, token_ids: list[int],
                      max_blocks: int | None = None) -> PrefixBlocks | None: ...

    def import_prefix(self, blocks: PrefixBlocks) -> int: ...

    # ---- embedding (task "embed") ------------------------------------------------------
    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]: ...

    def check_token_ids(self, inputs: Sequence[Sequence[int]],
                        truncate: bool) -> list[list[int]]: ...

    def embed(self, inputs: Sequence[Sequence[int]]) -> Vectors: ...

    # ---- following rank 0 (is_follower) ------------------------------------------------
    def run(self, stop_requested: Callable[[], bool]) -> None:
        """Serve rank 0's plans until a shutdown plan or stop_requested() (GroupError when
        the group fails)."""

    # ---- what it holds -----------------------------------------------------------------
    def weight_bytes(self) -> int | None:
        """The weights as held in memory; None: it cannot tell."""

    def kv_bytes_per_block(self) -> int | None:
        """Bytes one KV block takes over the layers this rank holds; None: no KV cache."""

    def stats(self) -> dict[str, Any]:
        """Scheduler figures; with a block pool, kv_blocks_used, kv_blocks_cached,
        kv_blocks_granted, kv_blocks_short and kv_blocks_total among them."""

    def grant_kv_blocks(self, num_blocks: int) -> None:
        """Let the KV cache touch up to num_blocks blocks (the node's grant)."""

    def release_kv_blocks(self, keep_blocks: int) -> int:
        """Hand back the memory of the free KV blocks above keep_blocks (the grant shrinks
        to what stays resident); returns how many blocks went."""

    def close(self) -> None:
        """Release what it holds (the other ranks of a split model stop too)."""


class NoGeneration:
    """EngineCore's generating and prefix-sharing members for an engine that serves no
    requests of its own (an embedding model, a follower rank)."""

    speculator: Speculator | None = None

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    variables: dict[str, Any] | None = None) -> str:
        raise ValueError("this engine generates no text")

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, grammar: GrammarSpec | None = None,
                    priority: int = 0, trace: RequestTrace | None = None) -> None:
        raise ValueError("this engine generates no text")

    def abort_request(self, request_id: str) -> None:
        pass  # it holds no requests

    def has_unfinished_requests(self) -> bool:
        return False

    def step(self) -> list[RequestOutput]:
        return []

    def idle(self) -> None:
        pass

    def prefix_pool(self) -> BlockPool | None:
        return None

    def kv_layout_key(self) -> str:
        return ""

    def export_prefix(self, token_ids: list[int],
                      max_blocks: int | None = None) -> PrefixBlocks | None:
        return None

    def import_prefix(self, blocks: PrefixBlocks) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {}

    def grant_kv_blocks(self, num_blocks: int) -> None:
        pass  # a follower's KV blocks are the ones rank 0 allocates; an embedder has none

    def release_kv_blocks(self, keep_blocks: int) -> int:
        return 0


class NoEmbedding:
    """EngineCore's embedding members for an engine that generates text."""

    dimensions: int | None = None

    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        raise ValueError("this engine generates text; it does not produce embeddings")

    def check_token_ids(self, inputs: Sequence[Sequence[int]],
                        truncate: bool) -> list[list[int]]:
        raise ValueError("this engine generates text; it does not produce embeddings")

    def embed(self, inputs: Sequence[Sequence[int]]) -> Vectors:
        raise ValueError("this engine generates text; it does not produce embeddings")


class NotFollower:
    """EngineCore's following members for an engine that schedules its own steps."""

    is_follower = False

    def run(self, stop_requested: Callable[[], bool]) -> None:
        raise ValueError("only a follower rank follows another rank's steps")
