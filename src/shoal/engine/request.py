"""Per-request state the scheduler keeps (pure Python; no torch).

The scheduler counts tokens, not phases: a request has `num_tokens` known tokens (prompt plus
output) of which `num_computed_tokens` already have KV entries. The difference is the work
still owed; it is 1 for a request in decode and larger while a prompt is being prefilled.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, field

from shoal.engine.outputs import FinishReason
from shoal.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # never scheduled yet
    RUNNING = "running"      # holds KV blocks and is scheduled every step
    PREEMPTED = "preempted"  # lost its blocks; waits to recompute its prompt and output
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it.

    priority: lower values are served first (0 is the default). arrival_index is assigned by
    the scheduler on add() and breaks ties between equal priorities (earlier first).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache on first admission (reported as usage).
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    arrival_index: int = 0
    # Chained hashes of the full blocks of prompt + output (filled by the scheduler).
    block_hashes: list[bytes] = field(default_factory=list)
    # How many leading blocks of block_ids are registered in the prefix cache.
    num_registered_blocks: int = 0
    num_preemptions: int = 0
    # Guessed next tokens (speculative decoding) for the next step to verify; set by the
    # engine before schedule(), consumed by it.
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0     # proposed over the request's life
    num_accepted_tokens: int = 0  # of those, verified and kept

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: priority first, then arrival."""
        return (self.priority, self.arrival_index)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens at positions start .. end-1 of prompt + output, without copying both lists."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def check_stop(self, eos_token_ids: Collection[int], max_model_len: int) -> FinishReason | None:
        """Why the request ends after its latest output token, or None to keep going.

        eos ends it unless ignore_eos; stop_token_ids always end it; both only once
        min_tokens outputs exist (the sampler bans them before that). Length limits apply
        regardless, so a request always terminates.
        """
        if not self.output_token_ids:
            return None
        params = self.params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in eos_token_ids:
                return "stop"
            if last in params.stop_token_ids:
                return "stop"
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return "length"
        if self.num_tokens >= max_model_len:
            return "length"
        return None
