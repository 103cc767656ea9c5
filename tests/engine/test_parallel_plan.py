"""Step plans and sampled steps survive their wire form unchanged."""

from __future__ import annotations

import torch

from shoal.engine.parallel.plan import (
    NewRequest,
    SampledStep,
    StepPlan,
    decode_plan,
    decode_sampled,
    encode_plan,
    encode_sampled,
)
from shoal.engine.sampler import SampledLogprobs
from shoal.engine.sampling import SamplingParams
from shoal.engine.scheduler_output import ScheduledChunk
from shoal.tracing.steps import RequestTrace


def test_a_step_plan_round_trips():
    mask = torch.zeros(49152, dtype=torch.bool)
    mask[[1, 7, 49151]] = True
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, stop=("\n",),
                            logit_bias={12: -1.5}, logprobs=True, top_logprobs=2)
    plan = StepPlan(kind="step",
                    chunks=(ScheduledChunk("a", (5,), 9, (0, 3), True),
                            ScheduledChunk("b", (1, 2, 3), 0, (7,), False)),
                    added=(NewRequest("a", (4, 4, 2), params),), removed=("old",),
                    allowed={"a": mask})
    back = decode_plan(encode_plan(plan))
    assert back.chunks == plan.chunks and back.added == plan.added
    assert back.removed == ("old",) and back.num_tokens == 4
    assert torch.equal(back.allowed["a"], mask)
    assert decode_plan(encode_plan(StepPlan(kind="keepalive"))).kind == "keepalive"


def test_new_requests_traces_travel_in_the_plan():
    traced = {"a": RequestTrace("a" * 32, "b" * 16), "b": RequestTrace("c" * 32)}
    back = decode_plan(encode_plan(StepPlan(kind="step", traced=traced)))
    assert back.traced == traced
    assert decode_plan(encode_plan(StepPlan(kind="keepalive"))).traced == {}


def test_a_sampled_step_round_trips():
    step = SampledStep(token_ids=(3, 9),
                       logprobs=(None, SampledLogprobs(9, -0.25, [(9, -0.25), (4, -1.5)])))
    assert decode_sampled(encode_sampled(step)) == step
