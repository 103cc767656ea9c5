"""The last pipeline rank's copy of each request's sampling state.

Penalties need a request's prompt and output so far, seeded requests their seed,
constrained ones their grammar's mask (which rank 0 computes and sends in the plan). The
mirror learns requests from the plans and appends the tokens it samples, so its view of
each output matches rank 0's token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shoal.engine.parallel.plan import SampledStep, StepPlan
from shoal.engine.sampler import Sampler, SamplingRow, position_generator
from shoal.engine.sampling import SamplingParams


@dataclass
class _Mirrored:
    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    output_token_ids: list[int] = field(default_factory=list)


class SamplingMirror:
    def __init__(self, sampler: Sampler, device: str | torch.device = "cpu") -> None:
        self._sampler = sampler
        self._device = torch.device(device)
        self._requests: dict[str, _Mirrored] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def apply(self, plan: StepPlan) -> None:
        """Track the added requests, then forget the removed ones (a request aborted before
        its first step is in both)."""
        for new in plan.added:
            self._requests[new.request_id] = _Mirrored(new.params, new.prompt_token_ids)
        for request_id in plan.removed:
            self._requests.pop(request_id, None)

    def sample(self, logits: torch.Tensor, plan: StepPlan) -> SampledStep:
        """logits: [S, V] float32, one row per sampled chunk of plan, in chunk order."""
        sampled = [c.request_id for c in plan.chunks if c.needs_sample]
        rows = []
        for request_id in sampled:
            state = self._requests.get(request_id)
            if state is None:
                raise KeyError(f"the plan samples request {request_id!r}, which was never "
                               "added")
            allowed = plan.allowed.get(request_id)
            rows.append(SamplingRow(params=state.params,
                                    prompt_token_ids=state.prompt_token_ids,
                                    output_token_ids=state.output_token_ids,
                                    # seeded exactly as a single engine seeds it
                                    generator=position_generator(
                                        state.params.seed, len(state.output_token_ids),
                                        self._device),
                                    allowed_tokens=None if allowed is None
                                    else allowed.to(logits.device)))
        result = self._sampler(logits, rows)
        for request_id, token_id in zip(sampled, result.token_ids):
            self._requests[request_id].output_token_ids.append(token_id)
        return SampledStep(token_ids=tuple(result.token_ids), logprobs=tuple(result.logprobs))
